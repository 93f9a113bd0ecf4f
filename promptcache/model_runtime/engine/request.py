"""Engine-side data: requests, their sequences, and the events sent back to callers."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from promptcache.cache_store import KVBlock
from promptcache.model_runtime.detokenizer import Detokenizer
from promptcache.model_runtime.engine.prefix import KVView, Stream
from promptcache.model_runtime.engine.reuse_plan import Fidelity, ReusePlan, WireEnum
from promptcache.model_runtime.kv_pool import KVPool
from promptcache.model_runtime.results import CacheReport, ModuleUse, Timings, Usage
from promptcache.model_runtime.sampling import PromptTokens, Sampler, SamplingParams, TokenLogprobs
from promptcache.pml import PromptPlan


class FinishReason(WireEnum):
    """Why a sample ended."""

    STOP = "stop"      # an end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens, or the model's last position
    ABORT = "abort"
    ERROR = "error"


class ErrorKind(WireEnum):
    """Why a request failed."""

    INVALID_REQUEST = "invalid_request"  # the request cannot be served as sent
    INTERNAL = "internal"


@dataclass(frozen=True, slots=True)
class RequestReport:
    """A request's last event's report: usage, timings and the cache report, or only the error when it failed."""

    usage: Usage | None = None
    timings: Timings | None = None
    cache: CacheReport | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # when asked for: each prompt token's from the second on
    error: str | None = None
    error_type: ErrorKind | None = None


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One step of one sample: a token (or none, on a final event) and the text it made safe to show. A sample's
    last event has `finish_reason`; the request's last carries its `report`."""

    request_id: str
    index: int
    token_id: int | None
    text: str
    finish_reason: FinishReason | None = None
    logprobs: TokenLogprobs | None = None  # of token_id, when the request asked for logprobs
    report: RequestReport | None = None


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(eq=False)
class SharedKV:
    """A cached KV block used by one or more sequences; identified by its view."""

    view: KVView
    block: KVBlock  # keys/values [num_layers, num_kv_heads, n, head_dim], referenced, never copied per sequence
    visible_from: int = 0  # in the prefill step only pending tokens from this index on (after it) see it; later, all


@dataclass(eq=False)
class Sequence:
    """One sample being generated, or the prompt its n > 1 samples fork from (`is_prompt`), with its own KV."""

    seq_id: int
    request: Request | None  # None for a module-encoding pseudo-sequence (engine/encoding.py)
    index: int
    shared: list[SharedKV]
    is_prompt: bool = False
    own_keys: torch.Tensor | None = None    # [num_layers, num_kv_heads, capacity, head_dim]
    own_values: torch.Tensor | None = None  # [num_layers, num_kv_heads, capacity, head_dim]
    # The pool own_keys/own_values are slots of, from slot `own_slot` on (None: buffers of their own).
    own_pool: KVPool | None = None
    own_slot: int | None = None
    own_length: int = 0
    own_positions: list[int] = field(default_factory=list)  # of the own KV's tokens, in its order (sliding windows)
    pending_ids: list[int] = field(default_factory=list)        # tokens still to feed
    pending_positions: list[int] = field(default_factory=list)
    prefill_done: int = 0  # prompt tokens fed by earlier chunks of this sequence's prefill
    next_position: int = 0
    output_ids: list[int] = field(default_factory=list)
    first_position: int = 0  # position of the first generated token
    generated_offset: int = 0  # where the generated tokens' KV starts in the own buffer
    status: SeqStatus = SeqStatus.WAITING
    sampler: Sampler | None = None
    detokenizer: Detokenizer | None = None

    @property
    def owner(self) -> Request:
        """The request this sequence samples for (a module-encoding pseudo-sequence has none)."""
        if self.request is None:
            raise ValueError(f"sequence {self.seq_id} encodes a module and belongs to no request")
        return self.request

    def own_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The own key and value buffers [num_layers, num_kv_heads, capacity, head_dim]."""
        if self.own_keys is None or self.own_values is None:
            raise ValueError(f"sequence {self.seq_id} has no own KV buffers yet")
        return self.own_keys, self.own_values

    def advance(self, num_tokens: int) -> None:
        """The first `num_tokens` pending tokens were fed (their KV written at own_length on): count them."""
        self.own_length += num_tokens
        self.own_positions += self.pending_positions[:num_tokens]
        self.pending_ids, self.pending_positions = self.pending_ids[num_tokens:], self.pending_positions[num_tokens:]
        if self.status == SeqStatus.PREFILL:
            self.prefill_done += num_tokens


@dataclass(eq=False)
class Request:
    """A submitted prompt plan with its sampling parameters; produces `n` sequences."""

    request_id: str
    plan: PromptPlan
    params: SamplingParams
    cache_salt: str | None
    fidelity: Fidelity = field(default_factory=Fidelity)
    # Whose queue it waits in (engine/scheduler.py) and whose byte share the KV it stores counts against
    # (its cache_salt scopes its keys to the same one, PromptRuntime); None: the default tenant.
    tenant: str | None = None
    report_spans: bool = False  # the final event lists the prompt as spans by KV origin
    submitted_at: float = field(default_factory=time.perf_counter)
    sequences: list[Sequence] = field(default_factory=list)
    modules: tuple[ModuleUse, ...] = ()
    reuse: ReusePlan | None = None  # resolved at admission
    use_tiers: tuple[str, ...] = ()  # the tier each of reuse.uses was fetched from, set at assembly
    stream: Stream | None = None  # the tokens computed for this request and the prefix reused for them
    held_keys: tuple[str, ...] = ()  # store keys acquired while the request runs
    computed_kv: dict[str, KVBlock] = field(default_factory=dict)  # module KV encoded while it waited, by key
    prompt_tokens: PromptTokens | None = None  # set at admission when sampling reads the prompt's ids
    num_computed_tokens: int = 0
    assembly_ms: float = 0.0
    encode_ms: float = 0.0
    lookup_ms: float = 0.0
    prefill_ms: float = 0.0
    first_token_at: float | None = None
    is_aborted: bool = False
    is_failed: bool = False
    prompt_logprobs: list[TokenLogprobs] | None = None  # filled while the prompt prefills

"""Engine-side data: requests, their sequences, and the events sent back to callers."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from promptcache.cache_store import KVBlock
from promptcache.model_runtime.detokenizer import Detokenizer
from promptcache.model_runtime.results import ModuleUse, Timings, Usage
from promptcache.model_runtime.sampling import Sampler, SamplingParams
from promptcache.pml import PromptPlan


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One step of one sample: a token (or none, on a final event) and the text it made safe to show.

    The last event of a sample has `finish_reason` set; the last event of the request also carries
    `usage`, `modules` and `timings` (and `error` if the request failed).
    """

    request_id: str
    index: int
    token_id: int | None
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    modules: tuple[ModuleUse, ...] | None = None
    timings: Timings | None = None
    is_exact: bool | None = None
    error: str | None = None
    error_type: str | None = None  # "invalid_request" (the request cannot be served) | "internal"


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(eq=False)
class SharedKV:
    """A cached KV block used by one or more sequences; identified by its store key."""

    key: str
    block: KVBlock  # keys/values [num_layers, num_kv_heads, n, head_dim], referenced, never copied per sequence


@dataclass(eq=False)
class Sequence:
    """One sample being generated. Its own KV holds its computed tokens (prompt text or generated)."""

    seq_id: int
    request: Request
    index: int
    shared: list[SharedKV]
    own_keys: torch.Tensor | None = None    # [num_layers, num_kv_heads, capacity, head_dim]
    own_values: torch.Tensor | None = None  # [num_layers, num_kv_heads, capacity, head_dim]
    own_length: int = 0
    pending_ids: list[int] = field(default_factory=list)        # tokens to feed in the next step
    pending_positions: list[int] = field(default_factory=list)
    next_position: int = 0
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    sampler: Sampler | None = None
    detokenizer: Detokenizer | None = None

    @property
    def own_capacity(self) -> int:
        return 0 if self.own_keys is None else self.own_keys.shape[2]


@dataclass(eq=False)
class Request:
    """A submitted prompt plan with its sampling parameters; produces `n` sequences."""

    request_id: str
    plan: PromptPlan
    params: SamplingParams
    cache_salt: str | None
    submitted_at: float = field(default_factory=time.perf_counter)
    sequences: list[Sequence] = field(default_factory=list)
    modules: tuple[ModuleUse, ...] = ()
    num_computed_tokens: int = 0
    assembly_ms: float = 0.0
    encode_ms: float = 0.0
    prefill_ms: float = 0.0
    first_token_at: float | None = None
    is_aborted: bool = False
    reserved_bytes: int = 0

"""Scheduler: admission round-robin across tenants under a sequence cap and a KV byte budget; token
bookkeeping per step."""

from __future__ import annotations

import itertools
import time

import torch

from promptcache.cache_store import KVBlock
from promptcache.model_runtime.detokenizer import Detokenizer
from promptcache.model_runtime.engine.assembly import assemble, module_key, store_key
from promptcache.model_runtime.engine.config import EngineConfig
from promptcache.model_runtime.engine.memory import KVMemory, OwnKV
from promptcache.model_runtime.engine.prefix import PrefixReuse
from promptcache.model_runtime.engine.prefix_writes import Write, logits_write, prompt_write, sample_write
from promptcache.model_runtime.engine.reports import failure_event, final_event, rejection_event
from promptcache.model_runtime.engine.request import Request, SeqStatus, Sequence, SharedKV, TokenEvent
from promptcache.model_runtime.engine.reuse_plan import resolve
from promptcache.model_runtime.engine.step_budget import StepBudget
from promptcache.model_runtime.engine.step_plan import compose_step
from promptcache.model_runtime.engine.waiting import WaitingRequests
from promptcache.model_runtime.errors import InvalidRequestError
from promptcache.model_runtime.module_encoder import ModuleEncoder
from promptcache.model_runtime.sampling import PromptTokens, Sampler, token_logprobs

PROMPT_SEQ = -1  # index of the sequence that prefills a prompt shared by n > 1 samples


class Scheduler:
    """Owns waiting requests and running sequences. `schedule` admits and picks the step's batch;
    `postprocess` turns the step's logits into tokens, events, finished sequences and freed memory.
    Used only on the engine thread, but for `waiting.reserve` (engine/waiting.py)."""

    def __init__(self, config: EngineConfig, encoder: ModuleEncoder, prefix: PrefixReuse) -> None:
        loaded = encoder.loaded
        self.config = config
        self.encoder = encoder
        self.prefix = prefix
        self.loaded = loaded
        self.waiting = WaitingRequests(config.max_waiting_per_tenant)
        self.running: list[Sequence] = []
        self.admitted: dict[str, Request] = {}  # requests with running sequences, by id
        self._aborted: list[Request] = []  # aborted since the last schedule: their final events are due
        self.memory = KVMemory(config.max_kv_bytes)
        self.step_budget = StepBudget(min(config.min_prefill_tokens, config.max_prefill_tokens),
                                      config.max_prefill_tokens, config.max_step_slowdown)
        self.bytes_per_token = loaded.kv_bytes_per_token
        self.own_kv = OwnKV(loaded, config.max_kv_bytes)
        self._seq_ids = itertools.count()
        self._reservations: dict[str, tuple[int, dict[str, int]]] = {}
        # Prefix blocks to store, run by the engine after the step's events went out (off the TTFT path).
        self.pending_stores: list[Write] = []
        # Module KV a parked request waits for, handed to the engine's encode queue after each schedule
        # (once per request: it is `resume`d when they are stored).
        self.encodes_needed: list[tuple[Request, int, tuple[int, ...]]] = []

    def add(self, request: Request, *, is_reserved: bool = False) -> None:
        """Queue `request` in its tenant's queue; `is_reserved`: its place was reserved when it was
        submitted (`waiting.reserve`). Raises QueueFullError otherwise when the queue is full."""
        if not is_reserved:
            self.waiting.reserve(request.tenant)
        self.waiting.add(request)

    def abort(self, request_id: str) -> None:
        """Mark a waiting or running request aborted (O(1)); the next `schedule` frees it and emits
        its final event. No-op for a request that finished or is unknown."""
        request = self.waiting.remove(request_id) or self.admitted.get(request_id)
        if request is not None and not request.is_aborted:
            request.is_aborted = True
            self._aborted.append(request)

    def resume(self, request: Request) -> None:
        """The module KV a parked request waited for is stored: it is the next its tenant admits."""
        self.waiting.resume(request.request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], list[TokenEvent], int]:
        """Drop aborted work, admit waiting requests (round-robin across tenants), return the sequences
        to run now, the events so far, and the prefill budget left for module encoding.

        The batch policy (decodes, chunked prefills, tenants' order) is `step_plan.compose_step`: prompt
        tokens share the learned step budget (`step_budget`) while anything decodes, else
        `max_prefill_tokens_alone`, or `max_prefill_tokens` while a tenant with nothing running waits (a
        second-long step would hold its first token back).
        """
        events = self._reap_aborted()
        self._admit(events)
        running_tenants = {s.request.tenant for s in self.running}
        others_wait = bool(self.waiting.tenants() - running_tenants)
        alone = self.config.max_prefill_tokens if others_wait else self.config.max_prefill_tokens_alone
        batch, budget = compose_step(self.running, mixed_budget=self.step_budget.tokens(), alone_budget=alone)
        return batch, events, budget

    def _num_running(self, tenant: str | None) -> int:
        return sum(1 for s in self.running if s.request.tenant == tenant)

    def missing_modules(self, request: Request) -> list[tuple[int, tuple[int, ...]]]:
        """(segment, context) of the module KV `request` reuses that no tier holds now."""
        assert request.reuse is not None
        return [(u.cached.segment.segment_id, tuple(u.cached.context_ids)) for u in request.reuse.uses
                if self.encoder.store.contains(module_key(self.encoder, request, u)) is None]

    # -- admission ------------------------------------------------------------------------------
    def _admit(self, events: list[TokenEvent]) -> None:
        """Admit heads in turn (waiting.py) until one does not fit. The head that does not fit blocks the
        rest (nobody overtakes a request waiting for memory or a sequence slot, so none starves), but a
        head whose module KV no tier holds is parked while the engine encodes it, and others go on, and
        a tenant that runs its share of the batch (all but `tenant_headroom_seqs`) is passed over."""
        at_share: set[str | None] = set()  # tenants whose next request would eat the others' headroom
        tenant_cap = self.config.max_num_seqs - self.config.tenant_headroom_seqs
        while (request := self.waiting.head(skip=at_share)) is not None:
            params = request.params
            n_seqs = params.n + (1 if params.n > 1 else 0)
            if self.running and len(self.running) + n_seqs > self.config.max_num_seqs:
                return
            if self.running and self._num_running(request.tenant) + n_seqs > tenant_cap:
                at_share.add(request.tenant)
                continue
            if request.reuse is None:
                request.reuse = resolve(request.plan, request.fidelity,
                                        can_shift=self.loaded.key_shifter is not None)
            reuse = request.reuse
            missing = self.missing_modules(request)
            if missing:  # encoded in chunks by the engine first; `resume`d when stored
                self.waiting.park(request)
                self.encodes_needed.extend((request, segment_id, context) for segment_id, context in missing)
                continue
            shared: dict[str, int] = {}
            for use in reuse.uses:  # runs of one module (tokens recomputed between) share its block: as _start
                key = module_key(self.encoder, request, use)
                shared[key] = max(shared.get(key, 0), (use.last - use.first) * self.bytes_per_token)
            # Upper bound: reused prefix tokens move from own KV to shared blocks, never adding bytes.
            own = (len(reuse.token_ids) + 1 + params.n * params.max_tokens) * self.bytes_per_token
            if self.memory.cost(own, shared) > self.memory.max_bytes:
                self.waiting.pop(request)
                events.append(rejection_event(request, f"the request needs {self.memory.cost(own, shared)} bytes of "
                                                   f"KV; the engine's budget is {self.memory.max_bytes}"))
                continue
            if not self.memory.fits(own, shared):
                return  # its tenant keeps the turn: admitted first when memory frees
            self.waiting.pop(request)
            try:
                own, shared, seq = self._start(request)
            except Exception as exc:  # one request's failure never touches another
                events.append(self.fail(request, exc))
                continue
            self.memory.reserve(own, shared)
            self._reservations[request.request_id] = (own, shared)
            self.admitted[request.request_id] = request
            logits = request.stream.logits if request.stream is not None else None
            if logits is not None and not seq.pending_ids:  # an exact repeat: its first token needs no pass
                try:
                    self._advance(seq, logits, 0.0, events)
                except Exception as exc:
                    events.append(self.fail(request, exc))

    def _start(self, request: Request) -> tuple[int, dict[str, int], Sequence]:
        """Assemble the request's reused KV and create its first sequence. Returns the own and shared
        KV bytes it holds, and the sequence."""
        params, reuse = request.params, request.reuse
        assert reuse is not None
        if params.prompt_logprobs is not None:
            if reuse.uses:
                raise InvalidRequestError("prompt logprobs need every prompt token computed; this prompt reuses "
                                          "module KV (send it as plain text or token ids)")
            request.prompt_logprobs = []
        assembled = assemble(request, reuse, self.encoder, self.prefix)
        request.stream = assembled.stream
        token_ids, shared = assembled.token_ids, assembled.shared
        # A view ("key#...", a range or shifted keys) shares its block's storage: hold and count the block under its store key.
        request.held_keys = tuple(dict.fromkeys(store_key(s.key) for s in shared))
        self.encoder.store.acquire(request.held_keys)
        request.num_computed_tokens = len(token_ids)
        if params.uses_prompt_tokens:  # the whole prompt, reused tokens included; shared by the n samples
            request.prompt_tokens = PromptTokens(request.plan.token_ids())
        index = PROMPT_SEQ if params.n > 1 else 0
        capacity = len(token_ids) + (0 if params.n > 1 else params.max_tokens)
        seq = self._new_sequence(request, index, shared, capacity)
        seq.pending_ids, seq.pending_positions = token_ids, assembled.position_ids
        seq.next_position = seq.first_position = reuse.next_position
        seq.generated_offset = len(token_ids)
        seq.status = SeqStatus.PREFILL
        own = (len(token_ids) + 1 + params.n * params.max_tokens) * self.bytes_per_token
        held: dict[str, int] = {}
        for item in shared:
            key = store_key(item.key)
            held[key] = max(held.get(key, 0), item.block.num_tokens * self.bytes_per_token)
        return own, held, seq

    def _new_sequence(self, request: Request, index: int, shared: list[SharedKV], capacity: int) -> Sequence:
        loaded = self.loaded
        seq = Sequence(seq_id=next(self._seq_ids), request=request, index=index, shared=shared)
        self.own_kv.attach(seq, capacity)
        if index != PROMPT_SEQ:
            seq.sampler = Sampler(request.params, seed_offset=index, prompt=request.prompt_tokens)
            seq.detokenizer = Detokenizer(loaded.tokenizer, request.params.stop)
            request.sequences.append(seq)
        self.running.append(seq)
        return seq

    # -- after a step ---------------------------------------------------------------------------
    def postprocess(self, batch: list[Sequence], logits: torch.Tensor, step_ms: float) -> list[TokenEvent]:
        """Sample a token for every sequence in `batch` from `logits` [len(batch), vocab]."""
        events: list[TokenEvent] = []
        for seq, row in zip(batch, logits):
            if seq.request.is_failed:
                continue
            if seq.status == SeqStatus.PREFILL and seq.pending_ids:
                seq.request.prefill_ms += step_ms  # a chunk of a long prefill: nothing to sample yet
                continue
            try:
                self._advance(seq, row, step_ms, events)
            except Exception as exc:  # sampling or detokenizing one sequence fails its request only
                events.append(self.fail(seq.request, exc))
        return events

    def _advance(self, seq: Sequence, row: torch.Tensor, step_ms: float, events: list[TokenEvent]) -> None:
        if seq.status == SeqStatus.PREFILL:
            seq.request.prefill_ms += step_ms
            self._queue_write(logits_write(seq, row, self.prefix))
            if seq.index != PROMPT_SEQ:
                self._queue_write(prompt_write(seq, self.prefix))
        if seq.index == PROMPT_SEQ:
            self._fork(seq, row, events)
        else:
            seq.status = SeqStatus.DECODE
            self._accept(seq, seq.sampler.sample(row), events, row)

    def _fork(self, prompt: Sequence, logits: torch.Tensor, events: list[TokenEvent]) -> None:
        request = prompt.request
        self.running.remove(prompt)
        n = prompt.own_length
        # The n samples reference the prompt's computed KV as one more shared block (a view, no copy).
        prompt_kv = SharedKV(f"{request.request_id}/prompt", KVBlock(
            prompt.own_keys[:, :, :n], prompt.own_values[:, :, :n],
            torch.arange(n, dtype=torch.long)))
        self._queue_write(prompt_write(prompt, self.prefix))
        for index in range(request.params.n):
            seq = self._new_sequence(request, index, [*prompt.shared, prompt_kv], request.params.max_tokens)
            seq.next_position = seq.first_position = prompt.next_position
            seq.status = SeqStatus.DECODE
            self._accept(seq, seq.sampler.sample(logits), events, logits)

    def _accept(self, seq: Sequence, token: int, events: list[TokenEvent], logits: torch.Tensor) -> None:
        request, params = seq.request, seq.request.params
        logprobs = None if params.logprobs is None else token_logprobs(logits, token, params.logprobs)
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        seq.output_ids.append(token)
        finish = None
        if token in self.loaded.eos_token_ids and not params.ignore_eos:
            finish, text = "stop", seq.detokenizer.flush()
        else:
            text = seq.detokenizer.push(token)
            if seq.detokenizer.is_stopped:
                finish = "stop"
            elif len(seq.output_ids) >= params.max_tokens or seq.next_position >= self.loaded.max_positions:
                finish = "length"
            if finish is not None:
                text += seq.detokenizer.flush()
        if finish is None:
            seq.pending_ids, seq.pending_positions = [token], [seq.next_position]
            seq.next_position += 1
            events.append(TokenEvent(request.request_id, seq.index, token, text, logprobs=logprobs))
            return
        seq.status, seq.finish_reason = SeqStatus.FINISHED, finish
        self.running.remove(seq)
        self._queue_write(sample_write(seq, self.prefix))
        if all(s.status == SeqStatus.FINISHED for s in request.sequences) and \
                len(request.sequences) == params.n:
            self._release(request)
            events.append(final_event(request, seq.index, token, text, finish, logprobs))
        else:
            events.append(TokenEvent(request.request_id, seq.index, token, text, finish, logprobs=logprobs))

    def _queue_write(self, write: Write | None) -> None:
        if write is not None:
            self.pending_stores.append(write)

    def _release(self, request: Request) -> None:
        self.own_kv.release(request.request_id)
        self.admitted.pop(request.request_id, None)
        reservation = self._reservations.pop(request.request_id, None)
        if reservation is not None:
            self.memory.release(*reservation)
        if request.held_keys:
            self.encoder.store.release(request.held_keys)
            request.held_keys = ()

    def _reap_aborted(self) -> list[TokenEvent]:
        """Free what the requests aborted since the last step hold (waiting ones left their queue at
        `abort`); one pass over the running sequences, none over the waiting requests."""
        aborted, self._aborted = self._aborted, []
        if any(r.request_id in self.admitted for r in aborted):
            self.running = [s for s in self.running if not s.request.is_aborted]
        for request in aborted:
            self._release(request)
        return [final_event(request, 0, None, "", "abort") for request in aborted]

    def fail(self, request: Request, exc: BaseException) -> TokenEvent:
        """Remove `request` wherever it is (waiting or running), free everything it holds, and return
        the event that fails it. Every other request is untouched."""
        request.is_failed = True
        self.waiting.remove(request.request_id)
        self.running = [s for s in self.running if s.request is not request]
        self._release(request)
        return failure_event(request, exc)

    def drop_all(self) -> list[Request]:
        """Forget every request (after an internal failure); returns them so callers can be told."""
        requests = {s.request.request_id: s.request for s in self.running}
        requests.update(self.admitted)
        requests.update({r.request_id: r for r in self.waiting.drain()})
        self.running.clear()
        self._aborted.clear()
        self.pending_stores.clear()  # they read own KV slots freed here, which the next step may rewrite
        for request in requests.values():
            self._release(request)
        return list(requests.values())

"""Scheduler: FCFS admission under a sequence cap and a KV byte budget; token bookkeeping per step."""

from __future__ import annotations

import itertools
import time
from collections import deque

import torch

from promptcache.cache_store import KVBlock
from promptcache.model_runtime.detokenizer import Detokenizer
from promptcache.model_runtime.engine.config import EngineConfig
from promptcache.model_runtime.engine.memory import KVMemory
from promptcache.model_runtime.engine.request import Request, SeqStatus, Sequence, SharedKV, TokenEvent
from promptcache.model_runtime.errors import EngineError
from promptcache.model_runtime.module_encoder import ModuleEncoder, check_positions
from promptcache.model_runtime.results import ModuleUse, Timings, Usage, slowest_tier
from promptcache.model_runtime.sampling import Sampler

PROMPT_SEQ = -1  # index of the sequence that prefills a prompt shared by n > 1 samples


class Scheduler:
    """Owns waiting requests and running sequences. `schedule` admits and picks the step's batch;
    `postprocess` turns the step's logits into tokens, events, finished sequences and freed memory."""

    def __init__(self, config: EngineConfig, encoder: ModuleEncoder) -> None:
        loaded = encoder.loaded
        self.config = config
        self.encoder = encoder
        self.loaded = loaded
        self.waiting: deque[Request] = deque()
        self.running: list[Sequence] = []
        self.memory = KVMemory(config.max_kv_bytes)
        element = torch.empty((), dtype=loaded.model.dtype).element_size()
        self.bytes_per_token = loaded.num_layers * loaded.num_kv_heads * loaded.head_dim * 2 * element
        self._seq_ids = itertools.count()
        self._reservations: dict[str, tuple[int, dict[str, int]]] = {}

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        for request in [*self.waiting, *(s.request for s in self.running)]:
            if request.request_id == request_id:
                request.is_aborted = True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], list[TokenEvent]]:
        """Drop aborted work, admit waiting requests (FCFS), return the sequences to run now."""
        events = self._reap_aborted()
        self._admit(events)
        return [s for s in self.running if s.pending_ids], events

    # -- admission ------------------------------------------------------------------------------
    def _admit(self, events: list[TokenEvent]) -> None:
        while self.waiting:
            request = self.waiting[0]
            n_seqs = request.params.n + (1 if request.params.n > 1 else 0)
            if self.running and len(self.running) + n_seqs > self.config.max_num_seqs:
                return
            plan, params = request.plan, request.params
            shared = {self.encoder.key(plan.schema, c.segment.segment_id, c.context_ids, request.cache_salt):
                      len(c.segment.token_ids) * self.bytes_per_token for c in plan.cached}
            own = (plan.num_new_tokens + 1 + params.n * params.max_tokens) * self.bytes_per_token
            if self.memory.cost(own, shared) > self.memory.max_bytes:
                self.waiting.popleft()
                events.append(self._error(request, f"the request needs {self.memory.cost(own, shared)} bytes of "
                                                   f"KV; the engine's budget is {self.memory.max_bytes}"))
                continue
            if not self.memory.fits(own, shared):
                return  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            try:
                self._start(request)
            except EngineError as exc:
                events.append(self._error(request, str(exc)))
                continue
            self.memory.reserve(own, shared)
            self._reservations[request.request_id] = (own, shared)

    def _start(self, request: Request) -> None:
        plan, params, loaded = request.plan, request.params, self.loaded
        started = time.perf_counter()
        before = self.encoder.num_encoded_segments
        fetched = [self.encoder.fetch(plan.schema, c.segment.segment_id, c.context_ids, request.cache_salt)
                   for c in plan.cached]
        device = loaded.model.device
        shared = [SharedKV(self.encoder.key(plan.schema, c.segment.segment_id, c.context_ids, request.cache_salt),
                           f.block.to(device)) for c, f in zip(plan.cached, fetched)]
        if self.encoder.num_encoded_segments != before:
            request.encode_ms = (time.perf_counter() - started) * 1e3
        token_ids, positions = plan.new_token_ids(), plan.new_position_ids()
        if not token_ids:  # recompute the highest-positioned cached token to get its logits
            last = shared[-1]
            n = last.block.num_tokens - 1
            shared[-1] = SharedKV(last.key + "#head", KVBlock(last.block.keys[:, :, :n], last.block.values[:, :, :n],
                                                             last.block.position_ids[:n]))
            segment = plan.cached[-1].segment
            token_ids, positions = [segment.token_ids[-1]], [segment.end - 1]
        check_positions(positions, loaded.max_positions)
        tiers: dict[str, list[str]] = {}
        for c, f in zip(plan.cached, fetched):
            tiers.setdefault(c.segment.owner, []).append(f.tier)
        request.modules = tuple(
            ModuleUse(p, sum(len(c.segment.token_ids) for c in plan.cached if c.segment.owner == p),
                      slowest_tier(tiers.get(p, ["computed"]))) for p in plan.module_paths)
        request.num_computed_tokens = len(token_ids)
        index = PROMPT_SEQ if params.n > 1 else 0
        capacity = len(token_ids) + (0 if params.n > 1 else params.max_tokens)
        seq = self._new_sequence(request, index, shared, capacity)
        seq.pending_ids, seq.pending_positions = list(token_ids), list(positions)
        seq.next_position = max(plan.position_ids()) + 1
        seq.status = SeqStatus.PREFILL
        request.assembly_ms = (time.perf_counter() - started) * 1e3

    def _new_sequence(self, request: Request, index: int, shared: list[SharedKV], capacity: int) -> Sequence:
        loaded = self.loaded
        shape = (loaded.num_layers, loaded.num_kv_heads, max(capacity, 1), loaded.head_dim)
        seq = Sequence(seq_id=next(self._seq_ids), request=request, index=index, shared=shared,
                       own_keys=torch.empty(shape, dtype=loaded.model.dtype, device=loaded.model.device),
                       own_values=torch.empty(shape, dtype=loaded.model.dtype, device=loaded.model.device))
        if index != PROMPT_SEQ:
            seq.sampler = Sampler(request.params, seed_offset=index)
            seq.detokenizer = Detokenizer(loaded.tokenizer, request.params.stop)
            request.sequences.append(seq)
        self.running.append(seq)
        return seq

    # -- after a step ---------------------------------------------------------------------------
    def postprocess(self, batch: list[Sequence], logits: torch.Tensor, step_ms: float) -> list[TokenEvent]:
        """Sample a token for every sequence in `batch` from `logits` [len(batch), vocab]."""
        events: list[TokenEvent] = []
        for seq, row in zip(batch, logits):
            request = seq.request
            if seq.status == SeqStatus.PREFILL:
                request.prefill_ms = step_ms
            if seq.index == PROMPT_SEQ:
                self._fork(seq, row, events)
            else:
                seq.status = SeqStatus.DECODE
                self._accept(seq, seq.sampler.sample(row), events)
        return events

    def _fork(self, prompt: Sequence, logits: torch.Tensor, events: list[TokenEvent]) -> None:
        request = prompt.request
        self.running.remove(prompt)
        n = prompt.own_length
        # The n samples reference the prompt's computed KV as one more shared block (a view, no copy).
        prompt_kv = SharedKV(f"{request.request_id}/prompt", KVBlock(
            prompt.own_keys[:, :, :n], prompt.own_values[:, :, :n],
            torch.arange(n, dtype=torch.long)))
        for index in range(request.params.n):
            seq = self._new_sequence(request, index, [*prompt.shared, prompt_kv], request.params.max_tokens)
            seq.next_position = prompt.next_position
            seq.status = SeqStatus.DECODE
            self._accept(seq, seq.sampler.sample(logits), events)

    def _accept(self, seq: Sequence, token: int, events: list[TokenEvent]) -> None:
        request, params = seq.request, seq.request.params
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
            events.append(TokenEvent(request.request_id, seq.index, token, text))
            return
        seq.status, seq.finish_reason = SeqStatus.FINISHED, finish
        self.running.remove(seq)
        if all(s.status == SeqStatus.FINISHED for s in request.sequences) and \
                len(request.sequences) == params.n:
            self._release(request)
            events.append(self._final(request, seq.index, token, text, finish))
        else:
            events.append(TokenEvent(request.request_id, seq.index, token, text, finish))

    def _final(self, request: Request, index: int, token: int | None, text: str, finish: str) -> TokenEvent:
        plan = request.plan
        now = time.perf_counter()
        usage = Usage(prompt_tokens=plan.num_prompt_tokens, cached_tokens=plan.num_cached_tokens,
                      computed_tokens=request.num_computed_tokens,
                      completion_tokens=sum(len(s.output_ids) for s in request.sequences))
        first = request.first_token_at or now
        timings = Timings(encode_ms=request.encode_ms, assembly_ms=request.assembly_ms,
                          prefill_ms=request.prefill_ms, ttft_ms=(first - request.submitted_at) * 1e3,
                          total_ms=(now - request.submitted_at) * 1e3)
        return TokenEvent(request.request_id, index, token, text, finish, usage=usage, modules=request.modules,
                          timings=timings, is_exact=plan.is_exact)

    def _release(self, request: Request) -> None:
        reservation = self._reservations.pop(request.request_id, None)
        if reservation is not None:
            self.memory.release(*reservation)

    def _reap_aborted(self) -> list[TokenEvent]:
        events = []
        for request in [r for r in self.waiting if r.is_aborted]:
            self.waiting.remove(request)
            events.append(self._final(request, 0, None, "", "abort"))
        aborted = {s.request.request_id: s.request for s in self.running if s.request.is_aborted}
        for request_id, request in aborted.items():
            self.running = [s for s in self.running if s.request.request_id != request_id]
            self._release(request)
            events.append(self._final(request, 0, None, "", "abort"))
        return events

    def drop_all(self) -> list[Request]:
        """Forget every request (after an internal failure); returns them so callers can be told."""
        requests = {s.request.request_id: s.request for s in self.running}
        requests.update({r.request_id: r for r in self.waiting})
        self.running.clear()
        self.waiting.clear()
        for request in requests.values():
            self._release(request)
        return list(requests.values())

    def _error(self, request: Request, message: str) -> TokenEvent:
        return TokenEvent(request.request_id, 0, None, "", "error", error=message, error_type="invalid_request")

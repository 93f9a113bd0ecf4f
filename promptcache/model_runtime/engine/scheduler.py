"""Scheduler: admission from per-tenant queues (waiting.py), round-robin under a sequence cap and a KV byte
budget shared with module encoding (kv_budget.py), each admitted request's KV assembled (assembly.py), and the step's
batch (`schedule`)."""

from __future__ import annotations

import itertools
import time

from promptcache.model_runtime.engine.assembly import Assembled, MissingModules, assemble, missing_modules
from promptcache.model_runtime.engine.config import EngineConfig
from promptcache.model_runtime.engine.kv_budget import Fit, KVBudget
from promptcache.model_runtime.engine.memory import OwnKV, held_bytes, request_bytes
from promptcache.model_runtime.engine.prefix import PrefixReuse
from promptcache.model_runtime.engine.reports import failure_event, final_event, rejection_event
from promptcache.model_runtime.engine.request import FinishReason, Request, SeqStatus, Sequence, SharedKV, TokenEvent
from promptcache.model_runtime.engine.reuse_plan import CachedUse, resolve
from promptcache.model_runtime.engine.step_budget import SharedStepCap, StepBudget
from promptcache.model_runtime.engine.step_plan import EncodeNeed, StepPlan, compose_step
from promptcache.model_runtime.engine.waiting import WaitingRequests
from promptcache.model_runtime.module_encoder import ModuleEncoder


class Scheduler:
    """Owns waiting requests, running sequences and their KV. `schedule` admits requests and composes the step;
    OutputProcessor calls `new_sequence`, `finish` and `fail`. Engine thread only, but for `waiting.reserve`."""

    def __init__(self, config: EngineConfig, encoder: ModuleEncoder, prefix: PrefixReuse) -> None:
        self.config, self.encoder, self.prefix = config, encoder, prefix
        self.loaded = encoder.loaded
        self.waiting = WaitingRequests(config.max_waiting_per_tenant)
        self.running: list[Sequence] = []
        self.admitted: dict[str, Request] = {}  # requests with running sequences, by id
        self._aborted: list[Request] = []  # aborted since the last schedule: their final events are due
        self.kv = KVBudget(config.max_kv_bytes, config.tenant_kv_share)  # the engine's encode queue reserves in it too
        self.memory = self.kv.memory
        self.step_budget = StepBudget(min(config.min_prefill_tokens, config.max_prefill_tokens),
                                      config.max_prefill_tokens, config.max_step_slowdown, config.ttft_target_ms)
        self.bytes_per_token = self.loaded.kv_bytes_per_token
        self.own_kv = OwnKV(self.loaded, config.max_kv_bytes)
        self.shared_cap = SharedStepCap(config.shared_step_ratio or 1.0, config.min_prefill_tokens + 1)
        self._step_kind: tuple[bool, int | None] = (False, None)  # the last plan's: (light, max_rows)
        self._last_light_step = -float("inf")  # when a light tenant last got a step of its own (monotonic s)
        self._seq_ids = itertools.count()
        self._reservations: dict[str, tuple[int, dict[str, int]]] = {}

    def add(self, request: Request, *, is_reserved: bool = False) -> None:
        """Queue `request` in its tenant's queue, reserving its place unless `is_reserved` (QueueFullError)."""
        if not is_reserved:
            self.waiting.reserve(request.tenant)
        self.waiting.add(request)

    def abort(self, request_id: str) -> None:
        """Mark a waiting or running request aborted (O(1)), freed at the next `schedule`; no-op if it is gone."""
        request = self.waiting.remove(request_id) or self.admitted.get(request_id)
        if request is not None and not request.is_aborted:
            request.is_aborted = True
            self._aborted.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        """Drop aborted work, admit waiting requests and compose the step: prompt tokens share the learned `step_budget`
        while anything decodes, else `max_prefill_tokens_alone` (`max_prefill_tokens` while a newcomer waits)."""
        events = self._reap_aborted()
        ready: list = []
        encodes: list[EncodeNeed] = []
        self._admit(events, ready, encodes)
        # Within shared_window_s of a light tenant's step of its own, a step runs at most the cap's rows.
        capped = (self.config.shared_step_ratio is not None
                  and time.monotonic() - self._last_light_step <= self.config.shared_window_s)
        max_rows = self.shared_cap.cap() if capped else None
        short = max_rows is not None or bool(self.waiting.tenants() - {s.owner.tenant for s in self.running})
        alone = self.config.max_prefill_tokens if short else self.config.max_prefill_tokens_alone
        now = time.perf_counter()
        # Running order: the order compose_step feeds one tenant's prompts in (an estimate across tenants).
        queue = [((now - s.owner.submitted_at) * 1e3, len(s.pending_ids))
                 for s in self.running if s.status == SeqStatus.PREFILL]
        mixed = self.step_budget.tokens(len(queue) / max(1, len(self.running) - len(queue)), queue)
        batch, budget = compose_step(self.running, mixed_budget=mixed, alone_budget=alone,
                                     max_rows=max_rows, min_tokens=self.config.min_prefill_tokens)
        fed = {id(s.seq) for s in batch if s.seq.status != SeqStatus.PREFILL}
        is_light = bool(batch) and not fed and any(s.status != SeqStatus.PREFILL for s in self.running)
        self._step_kind = (is_light, max_rows)
        if is_light:
            self._last_light_step = time.monotonic()
        if max_rows is not None:  # the decodes fed go to the back: the ones left out come first next step
            self.running = [s for s in self.running if id(s) not in fed] + [s.seq for s in batch if id(s.seq) in fed]
        return StepPlan(batch, budget, tuple(ready), tuple(events), tuple(encodes))

    def observe(self, plan: StepPlan, forward_ms: float, step_ms: float) -> None:
        """Learn from a step: `forward_ms` its pass (the prefill budget), `step_ms` all of it (the shared-step cap)."""
        self.step_budget.observe(plan.num_decoding, plan.num_prompt_tokens, forward_ms)
        is_light, max_rows = self._step_kind
        if is_light:
            self.shared_cap.observe_light(step_ms)
        elif max_rows is not None and plan.num_decoding:
            self.shared_cap.observe_capped(plan.num_decoding + plan.num_prompt_tokens, step_ms)

    def _admit(self, events: list[TokenEvent], ready: list, encodes: list[EncodeNeed]) -> None:
        """Admit heads in turn until one must wait for memory, which blocks the rest (none starves), as does a module
        encoding waiting for it. Heads whose module KV no tier gives are parked (`encodes`); tenants at their share of
        sequence slots or KV bytes are passed over; exact repeats go to `ready`."""
        at_share: set[str | None] = set()  # tenants whose next request would eat the others' headroom
        tenant_cap = self.config.max_num_seqs - self.config.tenant_headroom_seqs
        while (request := self.waiting.head(skip=at_share)) is not None:
            self.kv.waiting_tenants = self.waiting.waiting_tenants()
            num_seqs = request.params.n + (1 if request.params.n > 1 else 0)
            if self.running and len(self.running) + num_seqs > self.config.max_num_seqs:
                return
            if self.running and sum(s.owner.tenant == request.tenant for s in self.running) + num_seqs > tenant_cap:
                at_share.add(request.tenant)
                continue
            if request.reuse is None:
                request.reuse = resolve(request.plan, request.fidelity, can_shift=self.loaded.key_shifter is not None)
            if missing := missing_modules(self.encoder, request):  # encoded in chunks by the engine first
                self._park(request, missing, encodes, recompute=False)
                continue
            own, shared = request_bytes(request, self.encoder)
            fit = self.kv.verdict(request.tenant, own, shared)
            if fit is Fit.NEVER:
                self.waiting.pop(request)
                events.append(rejection_event(request, f"the request needs {self.memory.cost(own, shared)} bytes of "
                                                       f"KV; the engine's budget is {self.memory.max_bytes}"))
                continue
            if fit is Fit.OVER_SHARE:  # another tenant's request goes first; this one waits for its tenant's KV
                at_share.add(request.tenant)
                continue
            if fit is Fit.NO_ROOM or self.kv.claims:
                return  # its tenant keeps the turn: admitted first when memory frees (after a waiting encoding)
            try:
                assembled = assemble(request, self.encoder, self.prefix)
            except Exception as exc:  # one request's failure never touches another
                self.waiting.pop(request)
                events.append(self.fail(request, exc))
                continue
            if isinstance(assembled, MissingModules):  # held where fetching is refused: recomputed
                self._park(request, list(assembled.uses), encodes, recompute=True)
                continue
            self.waiting.pop(request)
            try:
                own, shared, seq = self._start(request, assembled)
            except Exception as exc:
                events.append(self.fail(request, exc))
                continue
            self.kv.reserve(request.tenant, own, shared)
            self._reservations[request.request_id] = (own, shared)
            self.admitted[request.request_id] = request
            logits = request.stream.logits if request.stream is not None else None
            if logits is not None and not seq.pending_ids:  # an exact repeat: its first token needs no pass
                ready.append((seq, logits))

    def _park(self, request: Request, missing: list[CachedUse], encodes: list[EncodeNeed], *, recompute: bool) -> None:
        self.waiting.park(request)
        encodes += [EncodeNeed(request, u.cached.segment.segment_id, tuple(u.cached.context_ids), recompute)
                    for u in missing]

    def _start(self, request: Request, assembled: Assembled) -> tuple[int, dict[str, int], Sequence]:
        """Hold the request's assembled KV and create its first sequence; returns its own and shared KV bytes."""
        params, token_ids = request.params, assembled.token_ids
        self.encoder.store.acquire(request.held_keys)
        is_prompt = params.n > 1  # prefills the prompt its samples fork from
        seq = self.new_sequence(request, 0, assembled.shared,
                                len(token_ids) + (0 if is_prompt else params.max_tokens), is_prompt=is_prompt)
        seq.pending_ids, seq.pending_positions = token_ids, assembled.position_ids
        seq.next_position = seq.first_position = assembled.next_position
        seq.generated_offset = len(token_ids)
        seq.status = SeqStatus.PREFILL
        own = (len(token_ids) + 1 + params.n * params.max_tokens) * self.bytes_per_token
        return own, held_bytes(assembled.shared, self.bytes_per_token), seq

    def new_sequence(self, request: Request, index: int, shared: list[SharedKV], capacity: int, *,
                     is_prompt: bool = False) -> Sequence:
        """A running sequence (sample `index`, or the prompt samples fork from) with own KV for `capacity` tokens."""
        seq = Sequence(seq_id=next(self._seq_ids), request=request, index=index, shared=shared, is_prompt=is_prompt)
        self.own_kv.attach(seq, capacity)
        if not is_prompt:
            request.sequences.append(seq)
        self.running.append(seq)
        return seq

    def finish(self, seq: Sequence) -> bool:
        """`seq` leaves the batch; True when its request has nothing left running (all it holds is then freed)."""
        self.running.remove(seq)
        request = seq.owner
        if len(request.sequences) != request.params.n or any(s.status != SeqStatus.FINISHED for s in request.sequences):
            return False
        self._release(request)
        return True

    def fail(self, request: Request, exc: BaseException) -> TokenEvent:
        """Remove `request` wherever it is, free what it holds, and return the event that fails it."""
        request.is_failed = True
        self.waiting.remove(request.request_id)
        self.running = [s for s in self.running if s.request is not request]
        self._release(request)
        return failure_event(request, exc)

    def drop_all(self) -> list[Request]:
        """Forget every request (after an internal failure); returns them so callers can be told."""
        requests = {s.owner.request_id: s.owner for s in self.running}
        requests.update(self.admitted)
        requests.update({r.request_id: r for r in self.waiting.drain()})
        self.running.clear()
        self._aborted.clear()
        for request in requests.values():
            self._release(request)
        return list(requests.values())

    def _release(self, request: Request) -> None:
        self.own_kv.release(request.request_id)
        self.admitted.pop(request.request_id, None)
        reservation = self._reservations.pop(request.request_id, None)
        if reservation is not None:
            self.kv.release(request.tenant, *reservation)
        if request.held_keys:
            self.encoder.store.release(request.held_keys)
            request.held_keys = ()

    def _reap_aborted(self) -> list[TokenEvent]:
        """Free what the requests aborted since the last step hold; one pass over the running sequences."""
        aborted, self._aborted = self._aborted, []
        if any(r.request_id in self.admitted for r in aborted):
            self.running = [s for s in self.running if not s.owner.is_aborted]
        for request in aborted:
            self._release(request)
        return [final_event(request, 0, None, "", FinishReason.ABORT) for request in aborted]

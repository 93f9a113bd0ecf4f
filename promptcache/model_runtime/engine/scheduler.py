"""Scheduler: admission from per-tenant queues (WaitingRequests), round-robin under a sequence cap and a KV byte
budget, and the step's batch (`schedule` -> StepPlan); the running batch's KV accounting and own-KV pool; each
admitted request's KV assembled (`assemble`): the module KV and prefix blocks it reuses, the tokens left to compute."""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from promptcache.cache_store import KVBlock
from promptcache.model_runtime.engine.config import EngineConfig
from promptcache.model_runtime.engine.prefix import KVView, PrefixReuse
from promptcache.model_runtime.engine.reports import failure_event, final_event, rejection_event
from promptcache.model_runtime.engine.request import FinishReason, Request, SeqStatus, Sequence, SharedKV, TokenEvent
from promptcache.model_runtime.engine.reuse_plan import CachedUse, resolve
from promptcache.model_runtime.engine.step_budget import SharedStepCap, StepBudget
from promptcache.model_runtime.engine.step_plan import EncodeNeed, StepPlan, compose_step
from promptcache.model_runtime.errors import InvalidRequestError, QueueFullError
from promptcache.model_runtime.loading.loader import LoadedModel
from promptcache.model_runtime.module_encoder import ModuleEncoder, check_positions
from promptcache.model_runtime.packed_attention import KVPool
from promptcache.model_runtime.results import ModuleUse, slowest_tier
from promptcache.model_runtime.sampling import PromptTokens


class Scheduler:
    """Owns waiting requests, running sequences and their KV. `schedule` admits requests and composes the step;
    OutputProcessor calls `new_sequence`, `finish` and `fail`. Engine thread only, but for `waiting.reserve`."""

    def __init__(self, config: EngineConfig, encoder: ModuleEncoder, prefix: PrefixReuse) -> None:
        self.config = config
        self.encoder = encoder
        self.prefix = prefix
        self.loaded = encoder.loaded
        self.waiting = WaitingRequests(config.max_waiting_per_tenant)
        self.running: list[Sequence] = []
        self.admitted: dict[str, Request] = {}  # requests with running sequences, by id
        self._aborted: list[Request] = []  # aborted since the last schedule: their final events are due
        self.memory = KVMemory(config.max_kv_bytes)
        self.step_budget = StepBudget(min(config.min_prefill_tokens, config.max_prefill_tokens),
                                      config.max_prefill_tokens, config.max_step_slowdown)
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

    def resume(self, request: Request) -> None:
        """The module KV a parked request waited for is stored: it is the next its tenant admits."""
        self.waiting.resume(request.request_id)

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
        others_wait = bool(self.waiting.tenants() - {s.owner.tenant for s in self.running})
        max_rows = self._shared_rows()
        short = others_wait or max_rows is not None
        alone = self.config.max_prefill_tokens if short else self.config.max_prefill_tokens_alone
        prefilling = sum(1 for s in self.running if s.status == SeqStatus.PREFILL)
        mixed = self.step_budget.tokens(prefilling / max(1, len(self.running) - prefilling))
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

    def _shared_rows(self) -> int | None:
        """The rows a step may run within `shared_window_s` of a light tenant's step of its own, else None."""
        if (self.config.shared_step_ratio is None
                or time.monotonic() - self._last_light_step > self.config.shared_window_s):
            return None
        return self.shared_cap.cap()

    def missing_modules(self, request: Request) -> list[CachedUse]:
        """The uses of module KV `request` reuses that no tier holds now (and nobody encoded for it)."""
        assert request.reuse is not None
        keys = [module_key(self.encoder, request, u) for u in request.reuse.uses]
        return [u for u, key in zip(request.reuse.uses, keys)
                if key not in request.computed_kv and self.encoder.store.tier_of(key) is None]

    def _admit(self, events: list[TokenEvent], ready: list, encodes: list[EncodeNeed]) -> None:
        """Admit heads in turn until one does not fit, which blocks the rest (none starves). Heads whose module KV no
        tier gives are parked (`encodes`); tenants at their share are passed over; exact repeats go to `ready`."""
        at_share: set[str | None] = set()  # tenants whose next request would eat the others' headroom
        tenant_cap = self.config.max_num_seqs - self.config.tenant_headroom_seqs
        while (request := self.waiting.head(skip=at_share)) is not None:
            num_seqs = request.params.n + (1 if request.params.n > 1 else 0)
            if self.running and len(self.running) + num_seqs > self.config.max_num_seqs:
                return
            if self.running and sum(s.owner.tenant == request.tenant for s in self.running) + num_seqs > tenant_cap:
                at_share.add(request.tenant)
                continue
            if request.reuse is None:
                request.reuse = resolve(request.plan, request.fidelity, can_shift=self.loaded.key_shifter is not None)
            if missing := self.missing_modules(request):  # encoded in chunks by the engine first
                self._park(request, missing, encodes, recompute=False)
                continue
            own, shared = request_bytes(request, self.encoder)
            if self.memory.cost(own, shared) > self.memory.max_bytes:
                self.waiting.pop(request)
                events.append(rejection_event(request, f"the request needs {self.memory.cost(own, shared)} bytes of "
                                                       f"KV; the engine's budget is {self.memory.max_bytes}"))
                continue
            if not self.memory.fits(own, shared):
                return  # its tenant keeps the turn: admitted first when memory frees
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
            self.memory.reserve(own, shared)
            self._reservations[request.request_id] = (own, shared)
            self.admitted[request.request_id] = request
            logits = request.stream.logits if request.stream is not None else None
            if logits is not None and not seq.pending_ids:  # an exact repeat: its first token needs no pass
                ready.append((seq, logits))

    def _park(self, request: Request, missing: list[CachedUse], encodes: list[EncodeNeed], *, recompute: bool) -> None:
        """Set `request` aside until the module KV of `missing` is encoded (`resume`d then)."""
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
        sequences = request.sequences
        if len(sequences) == request.params.n and all(s.status == SeqStatus.FINISHED for s in sequences):
            self._release(request)
            return True
        return False

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
            self.memory.release(*reservation)
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


class KVMemory:
    """Tracks bytes reserved against a budget. Shared blocks are reference-counted by key."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.own_bytes = 0
        self.shared: dict[str, list[int]] = {}  # key -> [nbytes, refcount]

    @property
    def used_bytes(self) -> int:
        return self.own_bytes + sum(entry[0] for entry in self.shared.values())

    def cost(self, own_bytes: int, shared: dict[str, int]) -> int:
        """Bytes a new request would add: its own KV and the shared blocks not yet resident."""
        return own_bytes + sum(n for key, n in shared.items() if key not in self.shared)

    def fits(self, own_bytes: int, shared: dict[str, int]) -> bool:
        return self.used_bytes + self.cost(own_bytes, shared) <= self.max_bytes

    def reserve(self, own_bytes: int, shared: dict[str, int]) -> None:
        self.own_bytes += own_bytes
        for key, nbytes in shared.items():
            entry = self.shared.setdefault(key, [nbytes, 0])
            entry[1] += 1
        assert self.used_bytes <= self.max_bytes, "KV budget exceeded"

    def release(self, own_bytes: int, shared: dict[str, int]) -> None:
        self.own_bytes -= own_bytes
        for key in shared:
            entry = self.shared[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self.shared[key]
        assert self.own_bytes >= 0


def request_bytes(request: Request, encoder: ModuleEncoder) -> tuple[int, dict[str, int]]:
    """Before assembly, a bound of the own KV bytes `request` adds and its shared blocks' bytes, by key."""
    reuse, params, per_token = request.reuse, request.params, encoder.loaded.kv_bytes_per_token
    assert reuse is not None
    shared: dict[str, int] = {}
    for use in reuse.uses:  # runs of one module (tokens recomputed between) share its block: held_bytes
        key = module_key(encoder, request, use)
        shared[key] = max(shared.get(key, 0), (use.last - use.first) * per_token)
    return (len(reuse.token_ids) + 1 + params.n * params.max_tokens) * per_token, shared


def held_bytes(shared: list[SharedKV], bytes_per_token: int) -> dict[str, int]:
    """Bytes of each stored block that `shared` KV (views cut from it included) holds, by store key."""
    held: dict[str, int] = {}
    for item in shared:
        key = item.view.key
        held[key] = max(held.get(key, 0), item.block.num_tokens * bytes_per_token)
    return held


class OwnKV:
    """Running requests' own KV: KVPool slots held per request until `release` (no free range: buffers of their own)."""

    def __init__(self, loaded: LoadedModel, max_bytes: int) -> None:
        model = loaded.model
        self.pool = KVPool(num_layers=loaded.num_layers, num_kv_heads=loaded.num_kv_heads, head_dim=loaded.head_dim,
                           num_slots=max(1, max_bytes // loaded.kv_bytes_per_token), dtype=model.dtype,
                           device=model.device)
        self._held: dict[str, list[int]] = {}  # request id -> first slot of each of its sequences' ranges

    def attach(self, seq: Sequence, capacity: int) -> None:
        """Give `seq` (of a request) own KV for `capacity` tokens (at least one)."""
        capacity = max(capacity, 1)
        first = self.pool.allocate(capacity)
        if first is None:
            shape = (*self.pool.shape[:2], capacity, self.pool.shape[3])
            seq.own_keys = torch.empty(shape, dtype=self.pool.dtype, device=self.pool.device)
            seq.own_values = torch.empty(shape, dtype=self.pool.dtype, device=self.pool.device)
            return
        self._held.setdefault(seq.owner.request_id, []).append(first)
        seq.own_keys, seq.own_values = self.pool.slots(first, capacity)
        seq.own_pool, seq.own_slot = self.pool, first

    def release(self, request_id: str) -> None:
        """Free a request's slots (safe: its last readers, the step's prefix writes, run before the next pass)."""
        for first in self._held.pop(request_id, ()):
            self.pool.free(first)


RETRY_AFTER_S = 1  # a full queue drains as fast as the engine admits: a short wait, then the client retries


class WaitingRequests:
    """Requests not yet admitted, one FCFS queue per tenant: `head` is the first of the tenant whose turn it is, `pop`
    passes the turn on. A request whose module KV is encoded is `park`ed, then `resume`d at its queue's front. A tenant
    holds at most `max_per_tenant`, counted from `reserve` (thread-safe, unlike the rest) until they leave. All O(1) in
    requests."""

    def __init__(self, max_per_tenant: int) -> None:
        self.max_per_tenant = max_per_tenant
        self._queues: OrderedDict[str | None, OrderedDict[str, Request]] = OrderedDict()  # tenants in turn order
        self._parked: dict[str, Request] = {}
        self._requests: dict[str, Request] = {}  # every request queued or parked, by id
        self._counts: dict[str | None, int] = {}  # per tenant: reserved and not yet left
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def reserve(self, tenant: str | None, num_requests: int = 1) -> None:
        """Hold places for `num_requests` of `tenant`, all or none (QueueFullError; InvalidRequestError if never)."""
        if num_requests > self.max_per_tenant:
            raise InvalidRequestError(f"this request queues {num_requests} prompts; a tenant may have at most "
                                      f"{self.max_per_tenant} waiting (send fewer prompts per request)")
        with self._lock:
            count = self._counts.get(tenant, 0)
            if count + num_requests > self.max_per_tenant:
                raise QueueFullError(f"this tenant has {count} requests waiting, at most {self.max_per_tenant} "
                                     "may wait; retry after the ones queued are admitted",
                                     retry_after_s=RETRY_AFTER_S)
            self._counts[tenant] = count + num_requests

    def add(self, request: Request) -> None:
        """Queue a request whose place was reserved; a tenant new to the rotation takes its turn last."""
        self._requests[request.request_id] = request
        self._queues.setdefault(request.tenant, OrderedDict())[request.request_id] = request

    def tenants(self) -> set[str | None]:
        """Tenants with requests queued (parked ones aside). O(number of tenants)."""
        return set(self._queues)

    def head(self, skip: frozenset[str | None] | set[str | None] = frozenset()) -> Request | None:
        """The first request of the tenant whose turn it is, tenants in `skip` passed over. O(number of tenants)."""
        for tenant, queue in self._queues.items():
            if tenant not in skip:
                return next(iter(queue.values()))
        return None

    def pop(self, request: Request) -> None:
        """Remove the head `request` (admitted or refused); the turn passes to the next tenant."""
        self._unqueue(request)
        if request.tenant in self._queues:
            self._queues.move_to_end(request.tenant)
        self._leave(request)

    def park(self, request: Request) -> None:
        """Set the head `request` aside while its module KV is encoded; its tenant keeps the turn."""
        self._unqueue(request)
        self._parked[request.request_id] = request

    def resume(self, request_id: str) -> None:
        """A parked request's encodings finished: back to its queue's front (no-op if it left meanwhile)."""
        request = self._parked.pop(request_id, None)
        if request is not None:
            queue = self._queues.setdefault(request.tenant, OrderedDict())
            queue[request_id] = request
            queue.move_to_end(request_id, last=False)

    def remove(self, request_id: str) -> Request | None:
        """Take a request out wherever it waits (aborted, failed); None if it is not waiting."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        if self._parked.pop(request_id, None) is None:
            self._unqueue(request)
        self._leave(request)
        return request

    def drain(self) -> list[Request]:
        """Remove and return every waiting request."""
        requests = list(self._requests.values())
        for request in requests:
            self.remove(request.request_id)
        return requests

    def _unqueue(self, request: Request) -> None:
        queue = self._queues[request.tenant]
        del queue[request.request_id]
        if not queue:
            del self._queues[request.tenant]

    def _leave(self, request: Request) -> None:
        del self._requests[request.request_id]
        with self._lock:
            count = self._counts.get(request.tenant, 0) - 1
            if count > 0:
                self._counts[request.tenant] = count
            else:
                self._counts.pop(request.tenant, None)


@dataclass(eq=False)
class Assembled:
    """What a request's first sequence starts from."""

    shared: list[SharedKV]       # reused KV (views of stored blocks), with what may see it
    token_ids: list[int]         # stream tokens left to compute
    position_ids: list[int]
    next_position: int           # of the first generated token


@dataclass(frozen=True, slots=True)
class MissingModules:
    """Module KV no tier gave (evicted, or refused by the fetch policy): the request waits while it is encoded."""

    uses: tuple[CachedUse, ...]


def module_key(encoder: ModuleEncoder, request: Request, use: CachedUse) -> str:
    cached = use.cached
    return encoder.key(request.plan.schema, cached.segment.segment_id, cached.context_ids, request.cache_salt)


def assemble(request: Request, encoder: ModuleEncoder, prefix: PrefixReuse) -> Assembled | MissingModules:
    """Fetch the request's module KV (or what was encoded for it; none: MissingModules), open its stream and set its
    report fields. Raises PromptTooLongError, InvalidRequestError."""
    plan, loaded, reuse, params = request.plan, encoder.loaded, request.reuse, request.params
    assert reuse is not None
    if params.prompt_logprobs is not None and reuse.uses:
        raise InvalidRequestError("prompt logprobs need every prompt token computed; this prompt reuses "
                                  "module KV (send it as plain text or token ids)")
    device = loaded.model.device
    started = time.perf_counter()
    shared: list[SharedKV] = []
    tiers: dict[str, list[str]] = {}
    used: dict[str, int] = {}  # tokens of KV reused, by module path
    use_tiers: list[str] = []
    missing: list[CachedUse] = []
    module_keys = [module_key(encoder, request, use) for use in reuse.uses]
    for use, key in zip(reuse.uses, module_keys):
        segment = use.cached.segment
        if key in request.computed_kv:
            block, tier = request.computed_kv[key], "computed"
        else:
            fetched = encoder.fetch(plan.schema, segment.segment_id, use.cached.context_ids, request.cache_salt)
            if fetched is None:
                missing.append(use)
                continue
            block, tier = fetched
        block = block.to(device)
        # A range of the stored block is a distinct tensor; shifted keys move for this request only, when
        # the runner attends them.
        view = KVView(key, shift=use.shift)
        if (use.first, use.last) != (0, block.num_tokens):
            block = KVBlock(block.keys[:, :, use.first: use.last], block.values[:, :, use.first: use.last],
                            block.position_ids[use.first: use.last])
            view = KVView(key, use.first, use.last, use.shift)
        shared.append(SharedKV(view, block, use.visible_from))
        tiers.setdefault(segment.owner, []).append(tier)
        used[segment.owner] = used.get(segment.owner, 0) + use.last - use.first
        use_tiers.append(tier)
    if missing:
        return MissingModules(tuple(missing))
    request.computed_kv = {}  # held by its shared KV from here on
    looked_up = time.perf_counter()
    stream = prefix.open(module_keys, list(reuse.token_ids), list(reuse.position_ids), salt=request.cache_salt,
                         variant=reuse.variant, match=request.params.prompt_logprobs is None)
    reused = stream.num_reused
    request.lookup_ms = (time.perf_counter() - looked_up) * 1e3
    # Reused prefix blocks precede every stream token left to compute; module KV's visibility counts
    # stream tokens, of which the first `reused` are no longer computed.
    shared = [SharedKV(s.view, s.block, max(0, s.visible_from - reused)) for s in shared]
    # A partly used link is a range of its block: a distinct tensor, a view other than the whole block.
    shared += [SharedKV(KVView(link.key) if link.is_whole else KVView(link.key, 0, link.num_tokens),
                        link.block.to(device)) for link in stream.match.links]
    token_ids, positions = list(reuse.token_ids[reused:]), list(reuse.position_ids[reused:])
    check_positions(positions, loaded.max_positions)
    recomputed = dict(reuse.recomputed_from(reused))  # what this request recomputes itself
    request.use_tiers = tuple(use_tiers)
    after = reuse.encoded_after(plan.schema)
    request.modules = tuple(ModuleUse(path, used.get(path, 0), slowest_tier(tiers.get(path, ["computed"])),
                                      recomputed.get(path, 0), after.get(path)) for path in plan.module_paths)
    request.stream, request.num_computed_tokens = stream, len(token_ids)
    # A view (a range or shifted keys) shares its block's storage: it is held under its store key.
    request.held_keys = tuple(dict.fromkeys(s.view.key for s in shared))
    if params.prompt_logprobs is not None:
        request.prompt_logprobs = []
    if params.uses_prompt_tokens:  # the whole prompt, reused tokens included; shared by the n samples
        request.prompt_tokens = PromptTokens(plan.token_ids())
    request.assembly_ms = (time.perf_counter() - started) * 1e3
    return Assembled(shared, token_ids, positions, reuse.next_position)

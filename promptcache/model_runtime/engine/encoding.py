"""Module encoding inside engine steps: schema uploads and module KV no tier holds are pseudo-sequences fed in
chunks of the step's prefill budget (one pass would freeze every stream). Each owner (tenant) has a queue of its own,
served round-robin a chunk at a time; an owner's jobs run one at a time, planned when they start, so a job reuses the
links its owner's earlier ones stored (a shared missing context is computed once)."""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from promptcache.model_runtime.engine.kv_budget import Fit, KVBudget
from promptcache.model_runtime.engine.prefix import KVView
from promptcache.model_runtime.engine.request import Request, SeqStatus, Sequence, SharedKV
from promptcache.model_runtime.engine.runner import ModelRunner, RunOutput
from promptcache.model_runtime.engine.step_plan import EncodeNeed, ScheduledSeq, StepPlan
from promptcache.model_runtime.errors import InvalidRequestError
from promptcache.model_runtime.module_encoder import ChainWork, EncodeReport, ModuleEncoder
from promptcache.pml import Schema

_WHOLE = 1 << 30  # a prefill budget no job reaches: `encode_now` runs each job in one pass
# Names the pseudo-sequences' shared blocks uniquely in the process: a runner keeps concatenations of
# blocks by name (kv_groups.py), and may serve several queues (`encode_now`).
_seq_ids = itertools.count()


@dataclass(eq=False)
class EncodeJob:
    """Encode (segment, context) of a schema for `owner` unless stored; `done` resolves with the target's block (None:
    stored meanwhile). `keep_local`: in local tiers too; `recompute`: even if a tier holds it. `work`: its plan, made
    when it first comes up and kept while it waits for KV memory."""

    target: str  # its store key
    schema: Schema
    segment_id: int
    context_ids: tuple[int, ...]
    salt: str | None
    owner: str | None
    keep_local: bool = True
    recompute: bool = False
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    work: ChainWork | None = None


@dataclass(eq=False)
class _Active:
    job: EncodeJob
    work: ChainWork
    seq: Sequence
    num_bytes: int  # reserved in the KV budget until it ends
    compute_s: float = 0.0


@dataclass(eq=False)
class _OwnerJobs:
    """One owner's encodings: those not started, in order, and the one computing."""

    waiting: deque[EncodeJob] = field(default_factory=deque)
    active: _Active | None = None


class EncodeQueue:
    """Encode jobs, a FIFO per owner served round-robin: each step's chunk goes to the next owner in turn whose job
    can run, so one tenant's many (or long) encodings delay another's by a chunk per owner, not by all of them.
    Identical jobs (one target) are one, resolving every submitter. With a KVBudget, a job's KV (its tokens and the
    stored links it attends to) is reserved when it starts and freed when it ends: a job that would take its owner
    past its share waits while the others' run; one the budget lacks room for claims it (admission waits, as for a
    request: nobody overtakes it); one larger than the whole budget fails. Used only on the engine thread."""

    def __init__(self, encoder: ModuleEncoder, budget: KVBudget | None = None) -> None:
        self.encoder = encoder
        self.budget = budget
        self._owners: OrderedDict[str | None, _OwnerJobs] = OrderedDict()  # owners with jobs, in turn order
        self._by_target: dict[str, EncodeJob] = {}
        self._served: tuple[str | None, _Active] | None = None  # the owner and job of the last chunk given out

    @property
    def has_work(self) -> bool:
        return bool(self._owners)

    def submit(self, schema: Schema, segment_id: int, context_ids: tuple[int, ...], salt: str | None, *,
               owner: str | None = None, keep_local: bool = True, recompute: bool = False) -> EncodeJob:
        """Queue an encoding once per target (kept locally, recomputed if any submitter asks)."""
        target = self.encoder.key(schema, segment_id, context_ids, salt)
        job = self._by_target.get(target)
        if job is None:
            job = EncodeJob(target, schema, segment_id, tuple(context_ids), salt, owner, keep_local, recompute)
            self._by_target[target] = job
            if owner not in self._owners:  # a new owner takes its turn last
                self._owners[owner] = _OwnerJobs()
                self._note_owners()
            self._owners[owner].waiting.append(job)
        job.keep_local = job.keep_local or keep_local
        job.recompute = job.recompute or recompute
        return job

    def next_chunk(self, budget: int) -> ScheduledSeq | None:
        """The pseudo-sequence of the next owner in turn whose job runs (started here if it has none running), with up
        to `budget` of its tokens, or None; that owner's turn passes."""
        if budget <= 0:
            return None
        for owner in list(self._owners):
            jobs = self._owners[owner]
            if jobs.active is None:
                self._start_next(owner, jobs)
            if jobs.active is not None:
                self._owners.move_to_end(owner)
                self._served = (owner, jobs.active)
                seq = jobs.active.seq
                return ScheduledSeq(seq, min(len(seq.pending_ids), budget))
            if not jobs.waiting:
                self._drop_owner(owner)
        return None

    def after_run(self, chunk: ScheduledSeq, output: RunOutput) -> None:
        """`chunk` ran in `output`'s pass: store and resolve its job after its last chunk; a failed chunk fails it."""
        if self._served is None or self._served[1].seq is not chunk.seq:
            return
        (owner, active), error = self._served, output.encoding_error
        if error is None:
            active.compute_s += output.encoding_s or 0.0
            chunk.seq.advance(chunk.num_tokens)
            if chunk.seq.pending_ids:
                return
        self._served = None
        self._owners[owner].active = None
        if self.budget is not None:
            self.budget.release(owner, active.num_bytes, {})
        if not self._owners[owner].waiting:
            self._drop_owner(owner)
        self._by_target.pop(active.job.target, None)
        if error is not None:
            active.job.done.set_exception(error)
            return
        work, n = active.work, len(active.work.token_ids)
        self.encoder.record(work, active.compute_s)
        keys, values = active.seq.own_buffers()
        active.job.done.set_result(self.encoder.store_tail(work, keys[:, :, :n], values[:, :, :n],
                                                           local=active.job.keep_local))

    def _start_next(self, owner: str | None, jobs: _OwnerJobs) -> None:
        """Start the owner's next job that still has work, if its KV may be reserved now."""
        if self.budget is not None:
            self.budget.claims.discard(owner)
        while jobs.waiting:
            job = jobs.waiting[0]
            if job.work is None:
                try:
                    job.work = self.encoder.plan(job.schema, job.segment_id, job.context_ids, job.salt,
                                                 owner=job.owner, local=job.keep_local, assume_missing=job.recompute)
                except Exception as exc:  # e.g. positions past the model: this job fails, the queue goes on
                    self._end_unstarted(jobs, exc)
                    continue
                if job.work is None:  # stored meanwhile (another job, another replica)
                    self._end_unstarted(jobs, None)
                    continue
            work = job.work
            num_bytes = (len(work.token_ids) + sum(b.num_tokens for b in work.found)) * \
                self.encoder.loaded.kv_bytes_per_token
            fit = Fit.FITS if self.budget is None else self.budget.verdict(owner, num_bytes, {})
            if fit is Fit.NEVER:
                assert self.budget is not None
                self._end_unstarted(jobs, InvalidRequestError(
                    f"encoding a module of schema {job.schema.name!r} needs {num_bytes} bytes of KV; the engine's "
                    f"budget is {self.budget.memory.max_bytes}"))
                continue
            if fit is Fit.NO_ROOM:
                assert self.budget is not None
                self.budget.claims.add(owner)
            if fit is not Fit.FITS:  # over its share: the other owners' jobs run meanwhile
                return
            jobs.waiting.popleft()
            if self.budget is not None:
                self.budget.reserve(owner, num_bytes, {})
            jobs.active = _Active(job, work, self._sequence(work), num_bytes)
            return

    def _end_unstarted(self, jobs: _OwnerJobs, error: BaseException | None) -> None:
        """Resolve the owner's first waiting job without computing it: failed, or stored meanwhile (None)."""
        job = jobs.waiting.popleft()
        self._by_target.pop(job.target, None)
        if error is not None:
            job.done.set_exception(error)
        else:
            job.done.set_result(None)

    def _sequence(self, work: ChainWork) -> Sequence:
        """The pseudo-sequence computing `work`'s tokens after its stored links."""
        loaded, device = self.encoder.loaded, self.encoder.loaded.model.device
        # [num_layers, num_kv_heads, num_tokens, head_dim]
        shape = (loaded.num_layers, loaded.num_kv_heads, max(1, len(work.token_ids)), loaded.head_dim)
        seq_id = next(_seq_ids)
        shared = [SharedKV(KVView(f"encode-{seq_id}/{i}"), block.to(device)) for i, block in enumerate(work.found)]
        return Sequence(seq_id=seq_id, request=None, index=0, shared=shared,
                        own_keys=torch.empty(shape, dtype=loaded.model.dtype, device=device),
                        own_values=torch.empty(shape, dtype=loaded.model.dtype, device=device),
                        pending_ids=list(work.token_ids), pending_positions=list(work.position_ids),
                        status=SeqStatus.PREFILL)

    def _drop_owner(self, owner: str | None) -> None:
        del self._owners[owner]
        if self.budget is not None:
            self.budget.claims.discard(owner)
        self._note_owners()

    def _note_owners(self) -> None:
        if self.budget is not None:
            self.budget.encoding_owners = set(self._owners)


class ParkedEncodes:
    """The module encodings of requests parked at admission, each settled once: when its last encoding is stored
    (the blocks go to `Request.computed_kv`, the wait to its `encode_ms`) or its first fails."""

    def __init__(self, encodes: EncodeQueue) -> None:
        self.encodes = encodes
        self._settled: list[tuple[Request, BaseException | None]] = []

    def submit(self, needs: Iterable[EncodeNeed]) -> None:
        """Queue the encodings; the requests named are watched until settled."""
        pending: dict[str, tuple[Request, list[EncodeJob]]] = {}
        for need in needs:
            request = need.request
            job = self.encodes.submit(request.plan.schema, need.segment_id, need.context_ids, request.cache_salt,
                                      owner=request.tenant, recompute=need.recompute)
            pending.setdefault(request.request_id, (request, []))[1].append(job)
        for request, jobs in pending.values():
            self._watch(request, jobs)

    def settled(self) -> list[tuple[Request, BaseException | None]]:
        """Requests settled since the last call, with the error of the encoding that failed (or None)."""
        settled, self._settled = self._settled, []
        return settled

    def _watch(self, request: Request, jobs: list[EncodeJob]) -> None:
        left, is_settled, parked_at = len(jobs), False, time.perf_counter()

        def one_done(key: str, future: concurrent.futures.Future) -> None:
            nonlocal left, is_settled
            left -= 1
            error = future.exception()
            if error is None and future.result() is not None:
                request.computed_kv[key] = future.result()
            if not is_settled and (left == 0 or error is not None):
                is_settled = True
                request.encode_ms += (time.perf_counter() - parked_at) * 1e3
                self._settled.append((request, error))

        for job in jobs:
            job.done.add_done_callback(functools.partial(one_done, job.target))


class SchemaEncodes:
    """`Engine.encode_schema`'s encodings: a future resolves with an EncodeReport, or the first error."""

    def __init__(self, encodes: EncodeQueue) -> None:
        self.encodes = encodes
        self._pending: list[tuple[list[concurrent.futures.Future], concurrent.futures.Future, float, int]] = []

    def submit(self, schema: Schema, salt: str | None, owner: str | None, future: concurrent.futures.Future, *,
               keep_local: bool, second_encodings: bool) -> None:
        jobs = self.encodes.encoder.schema_jobs(schema, predecessors=second_encodings)
        futures = [self.encodes.submit(schema, sid, ctx, salt, owner=owner, keep_local=keep_local).done
                   for sid, ctx in jobs]
        self._pending.append((futures, future, time.perf_counter(), self.encodes.encoder.num_encoded_segments))

    def settle(self) -> None:
        """Resolve the schema encodings whose jobs are all done."""
        done = [entry for entry in self._pending if all(f.done() for f in entry[0])]
        for futures, future, started, before in done:
            self._pending.remove((futures, future, started, before))
            error = next((f.exception() for f in futures if f.exception() is not None), None)
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(EncodeReport(len(futures), self.encodes.encoder.num_encoded_segments - before,
                                               (time.perf_counter() - started) * 1e3))


def encode_now(encoder: ModuleEncoder, runner: ModelRunner, schema: Schema, jobs: list[tuple[int, tuple[int, ...]]],
               cache_salt: str | None = None, progress: Callable[[int, int], None] | None = None) -> EncodeReport:
    """Encode the `jobs` of `schema` no tier holds, now, one pass of `runner` each. Raises what failed."""
    started, before = time.perf_counter(), encoder.num_encoded_segments
    queue = EncodeQueue(encoder)
    for done, (segment_id, context_ids) in enumerate(jobs, 1):
        job = queue.submit(schema, segment_id, context_ids, cache_salt)
        while (chunk := queue.next_chunk(_WHOLE)) is not None:
            queue.after_run(chunk, runner.run(StepPlan((), 0, encoding=chunk)))
        job.done.result()
        if progress is not None:
            progress(done, len(jobs))
    return EncodeReport(len(jobs), encoder.num_encoded_segments - before, (time.perf_counter() - started) * 1e3)

"""Module encoding inside engine steps: missing module KV computed in chunks between decode steps.

Schema uploads and modules that no tier holds (a replica adopted the schema, an eviction, a new salt)
used to be encoded in one forward pass on the engine thread, freezing every stream for its duration.
Here each encoding is a pseudo-sequence that takes a chunk of the step's prefill budget, like a long
prompt. Jobs run one at a time, in order: a job is planned when it starts, so it reuses the links that
earlier jobs stored (two segments after the same missing context compute that context once).
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from promptcache.model_runtime.engine.request import Request, SeqStatus, Sequence, SharedKV
from promptcache.model_runtime.module_encoder import ChainWork, ModuleEncoder
from promptcache.pml import Schema


@dataclass(eq=False)
class EncodeJob:
    """Encode (segment, context) of a schema unless stored; `done` resolves when it is stored.
    `keep_local`: stored in this process's tiers too, not only the shared ones (False only while
    nobody here needs it: a schema upload's encoding on a cluster replica)."""

    schema: Schema
    segment_id: int
    context_ids: tuple[int, ...]
    salt: str | None
    keep_local: bool = True
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(eq=False)
class _Active:
    job: EncodeJob
    work: ChainWork
    seq: Sequence
    compute_s: float = 0.0


class EncodeQueue:
    """FIFO of encode jobs; at most one is computing. Used only on the engine thread."""

    def __init__(self, encoder: ModuleEncoder) -> None:
        self.encoder = encoder
        self._jobs: deque[EncodeJob] = deque()
        self._by_target: dict[str, EncodeJob] = {}
        self._active: _Active | None = None
        self._ids = itertools.count()

    @property
    def has_work(self) -> bool:
        return bool(self._jobs or self._active)

    def submit(self, schema: Schema, segment_id: int, context_ids: tuple[int, ...],
               salt: str | None, *, keep_local: bool = True) -> concurrent.futures.Future:
        """Queue an encoding (once per target: a job already queued is shared, and kept locally if any
        of its submitters asks for that)."""
        target = self.encoder.key(schema, segment_id, context_ids, salt)
        job = self._by_target.get(target)
        if job is None:
            job = EncodeJob(schema, segment_id, tuple(context_ids), salt, keep_local)
            self._by_target[target] = job
            self._jobs.append(job)
        job.keep_local = job.keep_local or keep_local
        return job.done

    def next_chunk(self, budget: int) -> Sequence | None:
        """The active job's pseudo-sequence with up to `budget` of its tokens scheduled, or None."""
        if budget <= 0:
            return None
        while self._active is None and self._jobs:
            self._activate(self._jobs.popleft())
        if self._active is None:
            return None
        seq = self._active.seq
        seq.step_len = min(len(seq.pending_ids), budget)
        return seq

    def after_step(self, seconds: float) -> None:
        """Account the step; store and resolve the active job if its last chunk just ran."""
        active = self._active
        if active is None:
            return
        active.compute_s += seconds
        if active.seq.pending_ids:
            return
        self._active = None
        self._by_target.pop(active.work.target, None)
        seq, work = active.seq, active.work
        self.encoder.record(work, active.compute_s)
        n = len(work.token_ids)
        self.encoder.store_tail(work, seq.own_keys[:, :, :n], seq.own_values[:, :, :n], local=active.job.keep_local)
        active.job.done.set_result(n)

    def fail_active(self, exc: BaseException) -> None:
        """The active job's chunk failed: fail its waiters, drop it."""
        if self._active is not None:
            job, self._active = self._active.job, None
            self._by_target.pop(self.encoder.key(job.schema, job.segment_id, job.context_ids, job.salt), None)
            job.done.set_exception(exc)

    def _activate(self, job: EncodeJob) -> None:
        try:
            work = self.encoder.plan(job.schema, job.segment_id, job.context_ids, job.salt, local=job.keep_local)
        except Exception as exc:  # e.g. positions past the model: this job fails, the queue goes on
            self._by_target.pop(self.encoder.key(job.schema, job.segment_id, job.context_ids, job.salt), None)
            job.done.set_exception(exc)
            return
        if work is None:  # stored meanwhile (another job, another replica)
            self._by_target.pop(self.encoder.key(job.schema, job.segment_id, job.context_ids, job.salt), None)
            job.done.set_result(0)
            return
        loaded = self.encoder.loaded
        device = loaded.model.device
        shape = (loaded.num_layers, loaded.num_kv_heads, max(1, len(work.token_ids)), loaded.head_dim)
        shared = [SharedKV(f"encode-{next(self._ids)}/{i}", block.to(device)) for i, block in enumerate(work.found)]
        seq = Sequence(seq_id=-1, request=None, index=0, shared=shared,
                       own_keys=torch.empty(shape, dtype=loaded.model.dtype, device=device),
                       own_values=torch.empty(shape, dtype=loaded.model.dtype, device=device),
                       pending_ids=list(work.token_ids), pending_positions=list(work.position_ids),
                       status=SeqStatus.PREFILL)
        self._active = _Active(job, work, seq)


class ParkedEncodes:
    """The module encodings of requests parked at admission (scheduler.py), queued once per request.
    A request is settled once: when its last encoding is stored, or its first fails. Futures resolve on
    the engine thread (EncodeQueue), so settling costs nothing per step for requests still waiting."""

    def __init__(self, encodes: EncodeQueue) -> None:
        self.encodes = encodes
        self._settled: list[tuple[Request, BaseException | None]] = []

    def submit(self, needed: list[tuple[Request, int, tuple[int, ...]]]) -> None:
        """Queue (request, segment, context) encodings; the requests named are watched until settled."""
        futures: dict[str, tuple[Request, list[concurrent.futures.Future]]] = {}
        for request, segment_id, context_ids in needed:
            future = self.encodes.submit(request.plan.schema, segment_id, context_ids, request.cache_salt)
            futures.setdefault(request.request_id, (request, []))[1].append(future)
        for request, pending in futures.values():
            self._watch(request, pending)

    def settled(self) -> list[tuple[Request, BaseException | None]]:
        """Requests settled since the last call, with the error of the encoding that failed (or None)."""
        settled, self._settled = self._settled, []
        return settled

    def _watch(self, request: Request, futures: list[concurrent.futures.Future]) -> None:
        left, is_settled = len(futures), False

        def one_done(future: concurrent.futures.Future) -> None:
            nonlocal left, is_settled
            left -= 1
            error = future.exception()
            if not is_settled and (left == 0 or error is not None):
                is_settled = True
                self._settled.append((request, error))

        for future in futures:
            future.add_done_callback(one_done)

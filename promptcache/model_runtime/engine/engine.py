"""Engine: continuous batching on a compute thread, token events delivered to asyncio callers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator

import torch

from promptcache.cache_store import BlockIndex
from promptcache.model_runtime.engine.config import EngineConfig
from promptcache.model_runtime.engine.encoding import EncodeQueue, ParkedEncodes
from promptcache.model_runtime.engine.prefix import PrefixReuse
from promptcache.model_runtime.engine.request import Request, SeqStatus, Sequence, TokenEvent
from promptcache.model_runtime.engine.reuse_plan import Fidelity, ReusePlan, resolve
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.engine.scheduler import Scheduler
from promptcache.model_runtime.module_encoder import EncodeReport, ModuleEncoder
from promptcache.model_runtime.sampling import SamplingParams
from promptcache.pml import PromptPlan, Schema

logger = logging.getLogger(__name__)


class Engine:
    """Serves prompt plans with continuous batching and shared-module attention.

    `submit` is called from an asyncio loop and returns an async iterator of TokenEvents (the last one
    has `usage`); `abort` stops a request within one step and frees its KV. Each tenant's requests wait
    in a bounded queue of their own, admitted round-robin across tenants (engine/waiting.py). All model
    compute runs on the engine's own thread — the event loop never blocks on it. Each step is schedule -> run ->
    postprocess, with data passed one way.
    """

    def __init__(self, encoder: ModuleEncoder, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.encoder = encoder
        loaded = encoder.loaded
        index = None if self.config.prefix is None else BlockIndex(
            encoder.store, self.config.prefix, model_fingerprint=loaded.model_fingerprint,
            tokenizer_fingerprint=loaded.tokenizer_fingerprint, bytes_per_token=loaded.kv_bytes_per_token)
        self.prefix = PrefixReuse(index, self.config.logits_cache_bytes)
        self.scheduler = Scheduler(self.config, encoder, self.prefix)
        self.encodes = EncodeQueue(encoder)
        self.parked_encodes = ParkedEncodes(self.encodes)
        self._schema_encodes: list[tuple[list[concurrent.futures.Future], concurrent.futures.Future, float, int]] = []
        self.runner = ModelRunner(encoder.loaded, backend=self.config.attention_backend,
                                  max_assembled_bytes=self.config.max_assembled_bytes)
        self._inbox: list[tuple[str, object]] = []
        self._wakeup = threading.Condition()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.num_steps = 0
        self.prefix_store_s = 0.0  # time spent storing prefix blocks (after tokens went out)

    # -- caller side (any thread with an asyncio loop) ------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="promptcache-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def submit(self, plan: PromptPlan, params: SamplingParams, *, cache_salt: str | None = None,
               request_id: str | None = None, fidelity: Fidelity | None = None,
               report_spans: bool = False, tenant: str | None = None) -> AsyncIterator[TokenEvent]:
        """Queue a request in `tenant`'s queue; iterate the result for its events (must be called on a
        running loop). `fidelity` (default: the engine's) says how module KV reused out of context is
        treated; `report_spans` puts the prompt's spans by KV origin on the final event. Raises
        QueueFullError when the tenant already has `max_waiting_per_tenant` requests waiting."""
        [events] = self.submit_many([plan], params, cache_salt=cache_salt, request_ids=[request_id],
                                    fidelity=fidelity, report_spans=report_spans, tenant=tenant)
        return events

    def submit_many(self, plans: list[PromptPlan], params: SamplingParams, *, cache_salt: str | None = None,
                    request_ids: list[str | None] | None = None, fidelity: Fidelity | None = None,
                    report_spans: bool = False, tenant: str | None = None) -> list[AsyncIterator[TokenEvent]]:
        """`submit` each plan, all or none: raises QueueFullError, queueing nothing, unless the tenant's
        queue has room for every plan now (InvalidRequestError if it never could)."""
        request_ids = [r or f"req-{next(self._ids)}" for r in (request_ids or [None] * len(plans))]
        loop = asyncio.get_running_loop()
        self.scheduler.waiting.reserve(tenant, len(plans))
        streams = []
        for plan, request_id in zip(plans, request_ids):
            queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
            self._sinks[request_id] = (loop, queue)
            self._post("submit", Request(request_id, plan, params, cache_salt, fidelity or self.config.fidelity,
                                         tenant=tenant, report_spans=report_spans))
            streams.append(self._events(request_id, queue))
        self.start()
        return streams

    def encode_schema(self, schema: Schema, cache_salt: str | None = None, *,
                      keep_local: bool = True) -> concurrent.futures.Future[EncodeReport]:
        """Encode every module KV of `schema` that no tier holds, in chunks between decode steps (no
        stream stalls for it). Await the result with `asyncio.wrap_future`; it raises what failed.
        `keep_local=False` stores it in the shared tiers only (if there are any) unless a request here
        needs it meanwhile: for a replica whose uploads other replicas serve."""
        future: concurrent.futures.Future[EncodeReport] = concurrent.futures.Future()
        self._post("encode", (schema, cache_salt, future, keep_local))
        self.start()
        return future

    def abort(self, request_id: str) -> None:
        """Stop a request; its last event has finish_reason "abort" unless it already finished."""
        self._post("abort", request_id)

    def explain(self, plan: PromptPlan, *, cache_salt: str | None = None,
                fidelity: Fidelity | None = None) -> tuple[ReusePlan, list[tuple[str, int]]]:
        """What serving `plan` now would do, without doing it: its ReusePlan and (tier, tokens) of each
        stored prefix block its stream would reuse (no fetch, no promotion; safe from any thread)."""
        reuse = resolve(plan, fidelity or self.config.fidelity, can_shift=self.encoder.loaded.key_shifter is not None)
        module_keys = [self.encoder.key(plan.schema, u.cached.segment.segment_id, u.cached.context_ids, cache_salt)
                       for u in reuse.uses]
        return reuse, self.prefix.peek(module_keys, list(reuse.token_ids), list(reuse.position_ids),
                                       salt=cache_salt, variant=reuse.variant)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    async def _events(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[TokenEvent]:
        try:
            while True:
                event = await queue.get()
                yield event
                if event.usage is not None or event.error is not None:
                    return
        finally:
            self._sinks.pop(request_id, None)
            self.abort(request_id)  # no-op when finished; frees the KV of an abandoned stream

    def _post(self, kind: str, item: object) -> None:
        with self._wakeup:
            self._inbox.append((kind, item))
            self._wakeup.notify()

    # -- engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not self._inbox and not self.scheduler.has_work and not self.encodes.has_work \
                        and not self._stopping:
                    self._wakeup.wait(self.config.idle_wait_s)
                if self._stopping:
                    return
                inbox, self._inbox = self._inbox, []
            for kind, item in inbox:
                if kind == "submit":
                    self.scheduler.add(item, is_reserved=True)  # type: ignore[arg-type]
                elif kind == "abort":
                    self.scheduler.abort(item)  # type: ignore[arg-type]
                else:
                    self._queue_schema(*item)  # type: ignore[misc]
            try:
                self._step()
            except Exception:  # a bug must not kill the engine silently: fail the running requests
                logger.exception("engine step failed")
                self._fail_all("internal engine error")

    def _queue_schema(self, schema: Schema, salt: str | None, future: concurrent.futures.Future,
                      keep_local: bool) -> None:
        jobs = self.encoder.schema_jobs(schema, predecessors=self.config.fidelity.context == "predecessor")
        futures = [self.encodes.submit(schema, sid, ctx, salt, keep_local=keep_local) for sid, ctx in jobs]
        self._schema_encodes.append((futures, future, time.perf_counter(), self.encoder.num_encoded_segments))

    def _step(self) -> None:
        batch, events, budget = self.scheduler.schedule()
        self.parked_encodes.submit(self.scheduler.encodes_needed)
        self.scheduler.encodes_needed.clear()
        encoding = self.encodes.next_chunk(budget)
        if batch or encoding is not None:
            fed = [s for s in batch if s.status == SeqStatus.PREFILL] + ([encoding] if encoding is not None else [])
            num_fed = sum(s.step_len or len(s.pending_ids) for s in fed)
            num_decoding = sum(1 for s in batch if s.status != SeqStatus.PREFILL)
            started = time.perf_counter()
            batch, logits = self._run(batch, encoding, events)
            step_ms = (time.perf_counter() - started) * 1e3
            if batch:
                events += self.scheduler.postprocess(batch, logits, step_ms)
            self.scheduler.step_budget.observe(num_decoding, num_fed, step_ms)
            self.num_steps += 1
        events += self._settle_encodes()
        for event in events:
            self._deliver(event)
        self._store_prefixes()

    def _run(self, batch: list, encoding: Sequence | None, events: list[TokenEvent]) -> tuple[list, torch.Tensor]:
        """One forward pass for the batch and the module-encoding chunk (if any; one pass, not two, so a
        schema upload costs streams only its tokens). If the pass fails, the encoding chunk runs alone
        (a failure fails only its waiters) and each sequence runs alone, so a request that breaks the
        model fails by itself (its KV slots are rewritten: a sequence's own length only advances after
        a successful pass). Returns the sequences that ran and their logits [len, vocab]."""
        started = time.perf_counter()
        try:
            logits = self.runner.run([*batch, encoding] if encoding is not None else batch)
        except Exception:
            logger.warning("a batch step failed; running its %d sequences one by one", len(batch), exc_info=True)
        else:
            if encoding is not None:
                self.encodes.after_step(time.perf_counter() - started)
            return batch, logits[: len(batch)]
        if encoding is not None:
            self._encode_step(encoding)
        done = []
        for seq in batch:
            if seq.request.is_failed:
                continue
            try:
                done.append((seq, self.runner.run([seq])[0]))
            except Exception as exc:
                events.append(self.scheduler.fail(seq.request, exc))
        done = [(seq, row) for seq, row in done if not seq.request.is_failed]
        return [seq for seq, _ in done], torch.stack([row for _, row in done]) if done else torch.empty(0)

    def _encode_step(self, seq: Sequence) -> None:
        """The module-encoding chunk alone (after a failed shared pass): a failure fails only its waiters."""
        started = time.perf_counter()
        try:
            self.runner.run([seq])
        except Exception as exc:
            logger.exception("module encoding failed")
            self.encodes.fail_active(exc)
            return
        self.encodes.after_step(time.perf_counter() - started)

    def _settle_encodes(self) -> list[TokenEvent]:
        """Resolve finished schema encodings; fail requests whose module encoding failed."""
        events = []
        for entry in list(self._schema_encodes):
            futures, future, started, before = entry
            if all(f.done() for f in futures):
                self._schema_encodes.remove(entry)
                errors = [f.exception() for f in futures if f.exception() is not None]
                if errors:
                    future.set_exception(errors[0])
                else:
                    future.set_result(EncodeReport(len(futures), self.encoder.num_encoded_segments - before,
                                                   (time.perf_counter() - started) * 1e3))
        for request, error in self.parked_encodes.settled():
            if request.request_id not in self.scheduler.waiting:  # aborted, failed or dropped meanwhile
                continue
            if error is not None:
                events.append(self.scheduler.fail(request, error))
            else:
                self.scheduler.resume(request)
        return events

    def _store_prefixes(self) -> None:
        stores, self.scheduler.pending_stores = self.scheduler.pending_stores, []
        started = time.perf_counter()
        for store in stores:
            try:
                store()
            except Exception:  # a failed cache write costs future hits, never this request
                logger.exception("storing prefix blocks failed")
        self.prefix_store_s += time.perf_counter() - started

    def _deliver(self, event: TokenEvent) -> None:
        sink = self._sinks.get(event.request_id)
        if sink is not None:
            loop, queue = sink
            loop.call_soon_threadsafe(queue.put_nowait, event)

    def _fail_all(self, message: str) -> None:
        for request in self.scheduler.drop_all():
            self._deliver(TokenEvent(request.request_id, 0, None, "", "error", error=message, error_type="internal"))

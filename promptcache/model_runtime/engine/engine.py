"""Engine: continuous batching with shared-module attention, on a thread of its own."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

from promptcache.cache_store import BlockIndex
from promptcache.model_runtime.engine.config import EngineConfig
from promptcache.model_runtime.engine.encoding import EncodeQueue, ParkedEncodes, SchemaEncodes
from promptcache.model_runtime.engine.outputs import OutputProcessor, Write
from promptcache.model_runtime.engine.prefix import PrefixReuse
from promptcache.model_runtime.engine.reports import error_event
from promptcache.model_runtime.engine.request import ErrorKind, Request, TokenEvent
from promptcache.model_runtime.engine.reuse_plan import Fidelity, resolve
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.engine.scheduler import Scheduler
from promptcache.model_runtime.module_encoder import EncodeReport, ModuleEncoder
from promptcache.model_runtime.results import CacheReport, planned_report
from promptcache.model_runtime.sampling import SamplingParams
from promptcache.pml import PromptPlan, Schema

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Submit:
    request: Request  # its place in its tenant's queue is reserved


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class EncodeSchema:
    """`Engine.encode_schema`: `future` resolves with its EncodeReport."""

    schema: Schema
    salt: str | None
    owner: str | None
    future: Future[EncodeReport]
    keep_local: bool
    second_encodings: bool


Message = Submit | Abort | EncodeSchema  # posted from any thread, handled on the engine thread in posting order


class Inbox:
    """Messages in posting order. `wakeup` guards them: a test holds it to post several as one batch."""

    def __init__(self) -> None:
        self.wakeup = threading.Condition()
        self._messages: list[Message] = []
        self.is_closed = False

    def post(self, message: Message) -> None:
        with self.wakeup:
            self._messages.append(message)
            self.wakeup.notify()

    def close(self) -> None:
        with self.wakeup:
            self.is_closed = True
            self.wakeup.notify()

    def take(self, is_idle: Callable[[], bool], wait_s: float) -> list[Message] | None:
        """Every message posted since the last take, waiting (rechecking every `wait_s`) while none and `is_idle()`."""
        with self.wakeup:
            while not self._messages and is_idle() and not self.is_closed:
                self.wakeup.wait(wait_s)
            if self.is_closed:
                return None
            messages, self._messages = self._messages, []
            return messages


class Engine:
    """Continuous batching with shared-module attention on its own thread: `submit` (on an asyncio loop) returns
    TokenEvents, the last with the report; `abort` stops a request within a step. A step: schedule, run, postprocess."""

    def __init__(self, encoder: ModuleEncoder, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.encoder = encoder
        loaded = encoder.loaded
        index = None if self.config.prefix is None else BlockIndex(
            encoder.store, self.config.prefix, model_fingerprint=loaded.model_fingerprint,
            tokenizer_fingerprint=loaded.tokenizer_fingerprint, bytes_per_token=loaded.kv_bytes_per_token,
            windows=loaded.layer_windows)
        self.prefix = PrefixReuse(index, self.config.logits_cache_bytes)
        self.scheduler = Scheduler(self.config, encoder, self.prefix)
        self.outputs = OutputProcessor(self.scheduler, self.prefix)
        self.runner = ModelRunner(loaded, backend=self.config.attention_backend,
                                  max_assembled_bytes=self.config.max_assembled_bytes,
                                  cuda_graphs=self.config.cuda_graphs, max_num_seqs=self.config.max_num_seqs,
                                  reserve_assembled=self.config.reserve_assembled)
        self.encodes = EncodeQueue(encoder, self.scheduler.kv)  # encodings' KV counts in the batch's budget
        self.parked_encodes = ParkedEncodes(self.encodes)
        self.schema_encodes = SchemaEncodes(self.encodes)
        self.inbox = Inbox()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self.num_steps = 0
        self.prefix_store_s = 0.0  # time spent storing prefix blocks (after tokens went out)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="promptcache-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self.inbox.close()
        if self._thread is not None:
            self._thread.join(timeout=30)
            stepping, self._thread = self._thread.is_alive(), None
            if stepping:
                return  # its step still reads the groups
        self.runner.groups.release()  # freed even while the engine object lives on (a reserve is 128 MiB)

    def submit(self, plan: PromptPlan, params: SamplingParams, *, cache_salt: str | None = None,
               request_id: str | None = None, fidelity: Fidelity | None = None,
               report_spans: bool = False, tenant: str | None = None) -> AsyncIterator[TokenEvent]:
        """Queue a request in `tenant`'s queue (on a running loop); iterate it for its events (QueueFullError)."""
        [events] = self.submit_many([plan], params, cache_salt=cache_salt, request_ids=[request_id],
                                    fidelity=fidelity, report_spans=report_spans, tenant=tenant)
        return events

    def submit_many(self, plans: list[PromptPlan], params: SamplingParams, *, cache_salt: str | None = None,
                    request_ids: list[str | None] | None = None, fidelity: Fidelity | None = None,
                    report_spans: bool = False, tenant: str | None = None) -> list[AsyncIterator[TokenEvent]]:
        """`submit` each plan, all or none (QueueFullError; InvalidRequestError if they could never fit)."""
        ids = [r or f"req-{next(self._ids)}" for r in (request_ids or [None] * len(plans))]
        loop = asyncio.get_running_loop()
        self.scheduler.waiting.reserve(tenant, len(plans))
        streams = []
        for plan, request_id in zip(plans, ids):
            queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
            self._sinks[request_id] = (loop, queue)
            request = Request(request_id, plan, params, cache_salt, fidelity or self.config.fidelity, tenant=tenant,
                              report_spans=report_spans)
            self.inbox.post(Submit(request))
            streams.append(self._events(request_id, queue))
        self.start()
        return streams

    def encode_schema(self, schema: Schema, cache_salt: str | None = None, *, owner: str | None = None,
                      keep_local: bool = True, second_encodings: bool = False) -> Future[EncodeReport]:
        """Encode `schema`'s module KV no tier holds, for `owner`, between decode steps (the future raises what failed);
        `keep_local=False`: shared tiers only; `second_encodings`: "predecessor" ones too."""
        future: Future[EncodeReport] = Future()
        self.inbox.post(EncodeSchema(schema, cache_salt, owner, future, keep_local, second_encodings))
        self.start()
        return future

    def abort(self, request_id: str) -> None:
        """Stop a request; its last event has finish_reason "abort" unless it already finished."""
        self.inbox.post(Abort(request_id))

    def explain(self, plan: PromptPlan, *, cache_salt: str | None = None,
                fidelity: Fidelity | None = None) -> CacheReport:
        """What serving `plan` now would reuse, from where, and compute (no fetch; lookups may reach shared tiers)."""
        reuse = resolve(plan, fidelity or self.config.fidelity, can_shift=self.encoder.loaded.key_shifter is not None)
        module_keys = [self.encoder.key(plan.schema, u.cached.segment.segment_id, u.cached.context_ids, cache_salt)
                       for u in reuse.uses]
        tiers = [self.encoder.store.tier_of(key) for key in module_keys]
        blocks = self.prefix.peek(module_keys, list(reuse.token_ids), list(reuse.position_ids), salt=cache_salt,
                                  variant=reuse.variant)
        return planned_report(plan, reuse, [None if tier is None else tier.name for tier in tiers], blocks)

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
                if event.report is not None:
                    return
        finally:
            self._sinks.pop(request_id, None)
            self.abort(request_id)  # no-op when finished; frees the KV of an abandoned stream

    def _loop(self) -> None:
        def is_idle() -> bool:
            return not self.scheduler.has_work and not self.encodes.has_work

        while (messages := self.inbox.take(is_idle, self.config.idle_wait_s)) is not None:
            for message in messages:
                self._handle(message)
            try:
                self._step()
            except Exception:  # a bug must not kill the engine silently: fail the running requests
                logger.exception("engine step failed")
                for request in self.scheduler.drop_all():
                    self._deliver(error_event(request.request_id, "internal engine error", ErrorKind.INTERNAL))

    def _handle(self, message: Message) -> None:
        if isinstance(message, Submit):
            self.scheduler.add(message.request, is_reserved=True)
        elif isinstance(message, Abort):
            self.scheduler.abort(message.request_id)
        else:
            self.schema_encodes.submit(message.schema, message.salt, message.owner, message.future,
                                       keep_local=message.keep_local, second_encodings=message.second_encodings)

    def _step(self) -> None:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        self.parked_encodes.submit(plan.encodes)
        plan = replace(plan, encoding=self.encodes.next_chunk(plan.prefill_budget))
        output = self.runner.run(plan)
        if plan.encoding is not None:  # a failed chunk fails the requests and uploads waiting for it
            self.encodes.after_run(plan.encoding, output)
        result = self.outputs.postprocess(plan, output)
        self.num_steps += plan.has_forward  # steps that ran the model
        self.schema_encodes.settle()
        for event in [*plan.events, *result.events, *self._settle_parked()]:
            self._deliver(event)
        self._store_prefixes(result.prefix_writes)
        if plan.has_forward:  # the whole step: a prompt arriving during it waits for all of it
            self.scheduler.observe(plan, output.step_ms, (time.perf_counter() - started) * 1e3)

    def _settle_parked(self) -> list[TokenEvent]:
        events = []
        for request, error in self.parked_encodes.settled():
            if request.request_id not in self.scheduler.waiting:  # aborted, failed or dropped meanwhile
                continue
            if error is not None:
                events.append(self.scheduler.fail(request, error))
            else:
                self.scheduler.waiting.resume(request.request_id)  # the next its tenant admits
        return events

    def _store_prefixes(self, writes: tuple[Write, ...]) -> None:
        started = time.perf_counter()
        for write in writes:
            try:
                write()
            except Exception:  # a failed cache write costs future hits, never this request
                logger.exception("storing prefix blocks failed")
        self.prefix_store_s += time.perf_counter() - started

    def _deliver(self, event: TokenEvent) -> None:
        sink = self._sinks.get(event.request_id)
        if sink is not None:
            loop, queue = sink
            loop.call_soon_threadsafe(queue.put_nowait, event)

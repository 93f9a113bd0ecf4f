"""Admission: round-robin across tenants, a bounded queue per tenant, requests that need no encoding
overtaking one whose modules are encoded, and O(1) abort of waiting requests; every answer still equals
the HF reference's."""

from __future__ import annotations

import asyncio
import time

import pytest

from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.engine import Engine, EngineConfig
from promptcache.model_runtime.engine.prefix import PrefixReuse
from promptcache.model_runtime.engine.request import Request
from promptcache.model_runtime.engine.reuse_plan import resolve
from promptcache.model_runtime.engine.scheduler import Scheduler
from promptcache.model_runtime.errors import InvalidRequestError, QueueFullError
from promptcache.pml import token_plan
from tests.conftest import make_tiny_runtime
from tests.model_runtime.oracles import reference_tokens
from tests.model_runtime.test_engine import SCHEMA

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
TEXTS = ["Once upon a time", "The sea was calm", "Numbers: one two", "Cats sleep a lot", "Tea is hot"]
ALL_DOCS = '<prompt schema="lib"><user><d0/><d1/><d2/><d3/><d4/>Which one is true?</user><assistant/></prompt>'


def _runtime(*, encode: bool = True):
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA), encode=encode)
    runtime.add_schema(runtime.parse_schema('<schema name="plain"/>'), encode=False)
    return runtime


def _text_plan(runtime, text: str):
    ids = runtime.loaded.tokenizer.encode(text, add_special_tokens=False)
    return token_plan(runtime.get_schema("plain"), tuple(ids))


async def _run(events, log: list, name: str) -> list[int]:
    tokens = []
    async for event in events:
        assert event.report is None or event.report.error is None, event.report
        if event.token_id is not None:
            tokens.append(event.token_id)
            log.append((name, "token"))
        if event.report is not None:
            log.append((name, "final"))
    return tokens


def test_a_second_tenant_is_admitted_before_the_first_ones_backlog(engines):
    runtime = _runtime()
    engine = Engine(runtime.module_encoder, EngineConfig(max_num_seqs=1, prefix=None))
    plans = [_text_plan(runtime, TEXTS[i % len(TEXTS)]) for i in range(51)]
    log: list = []

    async def main():
        with engine.inbox.wakeup:  # the engine thread takes all 51 submissions at once: one order to check
            tasks = [asyncio.create_task(_run(engine.submit(plan, GREEDY, tenant="a"), log, f"a{i}"))
                     for i, plan in enumerate(plans[:50])]
            tasks.append(asyncio.create_task(_run(engine.submit(plans[50], GREEDY, tenant="b"), log, "b")))
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    finished = [name for name, kind in log if kind == "final"]
    assert finished.index("b") == 1, finished  # after a's first (a's turn came first); FCFS: after all 50
    assert [n for n in finished if n != "b"] == [f"a{i}" for i in range(50)]  # a's own in order
    expected = {text: reference_tokens(runtime.loaded, _text_plan(runtime, text), GREEDY) for text in TEXTS}
    assert results == [expected[TEXTS[i % len(TEXTS)]] for i in range(51)]


def test_a_full_tenant_queue_refuses_submissions_until_one_leaves(engines):
    runtime = _runtime()
    engine = Engine(runtime.module_encoder, EngineConfig(max_num_seqs=1, max_waiting_per_tenant=3, prefix=None))
    long_params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
    plans = [_text_plan(runtime, text) for text in TEXTS]

    async def main():
        running = engine.submit(plans[0], long_params, request_id="long", tenant="a")
        await anext(running)  # admitted: the only sequence slot is taken until it is aborted
        queued = [engine.submit(plans[1], GREEDY, request_id=f"a{i}", tenant="a") for i in range(3)]
        with pytest.raises(QueueFullError) as full:
            engine.submit(plans[2], GREEDY, tenant="a")
        with pytest.raises(QueueFullError):
            engine.submit_many(plans[:1], GREEDY, tenant="a")
        with pytest.raises(InvalidRequestError, match="at most 3"):
            engine.submit_many(plans[:4], GREEDY, tenant="b")  # more than a queue holds: never a retry
        others = engine.submit_many(plans[:3], GREEDY, tenant="b")  # b's queue is its own
        engine.abort("a1")
        aborted = [event async for event in queued[1]]
        again = engine.submit(plans[3], GREEDY, tenant="a")  # a1 left: room for one
        with pytest.raises(QueueFullError):
            engine.submit(plans[3], GREEDY, tenant="a")
        engine.abort("long")
        [event async for event in running]
        results = [await _run(s, [], "") for s in [queued[0], queued[2], *others, again]]
        return full.value, aborted, results

    try:
        error, aborted, results = asyncio.run(main())
    finally:
        engine.stop()
    assert error.retry_after_s >= 1 and "3 requests waiting" in str(error)
    assert [e.finish_reason for e in aborted] == ["abort"] and aborted[0].token_id is None
    expected = [reference_tokens(runtime.loaded, plans[i], GREEDY) for i in (1, 1, 0, 1, 2, 3)]
    assert results == expected
    assert len(engine.scheduler.waiting) == 0 and engine.scheduler.memory.used_bytes == 0


def test_requests_needing_no_encoding_overtake_one_waiting_for_its_modules(engines):
    runtime = _runtime(encode=False)  # no tier holds the schema's module KV
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None, max_prefill_tokens=4,
                                                         max_prefill_tokens_alone=4))
    modules_plan = runtime.plan(ALL_DOCS)
    plain = [_text_plan(runtime, text) for text in TEXTS[:2]]
    submitted = []
    submit = engine.encodes.submit

    def counted(*args, **kwargs):
        submitted.append(args[1:3])
        return submit(*args, **kwargs)

    engine.encodes.submit = counted
    log: list = []

    async def main():
        tasks = [asyncio.create_task(_run(engine.submit(modules_plan, GREEDY), log, "modules"))]
        tasks += [asyncio.create_task(_run(engine.submit(plan, GREEDY), log, f"plain{i}"))
                  for i, plan in enumerate(plain)]
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    first_module_token = log.index(("modules", "token"))
    assert log.index(("plain0", "final")) < first_module_token and log.index(("plain1", "final")) < first_module_token
    uses = {(u.cached.segment.segment_id, tuple(u.cached.context_ids)) for u in resolve(modules_plan,
                                                                                         engine.config.fidelity).uses}
    assert len(submitted) == len(set(submitted)) == len(uses)  # queued once, not once per step it waited
    assert results[0] == reference_tokens(runtime.loaded, modules_plan, GREEDY)
    assert results[1:] == [reference_tokens(runtime.loaded, plan, GREEDY) for plan in plain]


def test_aborting_twenty_thousand_waiting_requests_is_linear():
    runtime = _runtime()
    scheduler = Scheduler(EngineConfig(prefix=None, max_waiting_per_tenant=20_000), runtime.module_encoder,
                          PrefixReuse(None))
    plan = _text_plan(runtime, TEXTS[0])
    for i in range(20_000):
        scheduler.add(Request(f"r{i}", plan, GREEDY, None, tenant=f"t{i % 7}"))
    started = time.perf_counter()
    for i in reversed(range(19_999)):  # the last one stays; from the back, so no scan finds one early
        scheduler.abort(f"r{i}")
    aborted = time.perf_counter()
    step = scheduler.schedule()
    reaped = time.perf_counter()
    # ~10 ms and ~0.3 s (the abort events) here; a look through the queue per abort is 2e8 steps
    assert aborted - started < 0.2 and reaped - aborted < 1.0, (aborted - started, reaped - aborted)
    assert len(step.events) == 19_999 and {e.finish_reason for e in step.events} == {"abort"}
    assert [s.seq.request.request_id for s in step.batch] == ["r19999"] and len(scheduler.waiting) == 0
    scheduler.abort("r19999")  # running: freed by the next schedule
    step = scheduler.schedule()
    assert not step.batch and [e.finish_reason for e in step.events] == ["abort"]
    assert scheduler.memory.used_bytes == 0


def test_a_failed_module_encoding_fails_its_parked_request_only(engines):
    runtime = _runtime(encode=False)
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None, max_waiting_per_tenant=2))

    def broken(*args, **kwargs):
        raise RuntimeError("injected encoding failure")

    engine.encoder.plan = broken  # every module encoding fails when it starts
    plain = _text_plan(runtime, TEXTS[0])

    async def main():
        failed = [event async for event in engine.submit(runtime.plan(ALL_DOCS), GREEDY, tenant="a")]
        served = await _run(engine.submit(plain, GREEDY, tenant="a"), [], "plain")
        again = engine.submit_many([plain, plain], GREEDY, tenant="a")  # both places are free again
        return failed, served, [await _run(events, [], "again") for events in again]

    try:
        failed, served, again = asyncio.run(main())
    finally:
        engine.stop()
    assert len(failed) == 1 and failed[0].report.error.startswith("internal error (id ")
    assert failed[0].report.error_type == "internal"
    assert served == reference_tokens(runtime.loaded, plain, GREEDY) and again == [served, served]


@pytest.mark.parametrize("share", [0.5, None], ids=["share", "no-share"])
def test_a_tenant_past_its_kv_share_is_passed_over_while_another_waits(share):
    """a's long requests hold most of the KV budget and its next one does not fit; b's short request does. With a
    share, a is past it while b waits, so b is admitted at once; without one, a's head keeps the turn and b waits for
    a request of a's to end."""
    runtime = _runtime()
    plan_a, plan_b = _text_plan(runtime, TEXTS[0]), _text_plan(runtime, TEXTS[1])
    long_params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    per_token = runtime.loaded.kv_bytes_per_token
    fidelity = EngineConfig().fidelity
    cost_a = (len(resolve(plan_a, fidelity).token_ids) + 1 + 200) * per_token  # own KV: prompt, a token, max_tokens
    cost_b = (len(resolve(plan_b, fidelity).token_ids) + 1 + GREEDY.max_tokens) * per_token
    config = EngineConfig(max_num_seqs=8, prefix=None, max_kv_bytes=3 * cost_a + cost_b + per_token,
                          tenant_kv_share=share)
    engine = Engine(runtime.module_encoder, config)
    log: list = []

    async def main():
        with engine.inbox.wakeup:  # a0-a2 are admitted together; a3 waits for memory
            tasks = [asyncio.create_task(_run(engine.submit(plan_a, long_params, tenant="a"), log, f"a{i}"))
                     for i in range(4)]
        while engine.num_running < 3:
            await asyncio.sleep(0.001)
        tasks.append(asyncio.create_task(_run(engine.submit(plan_b, GREEDY, tenant="b"), log, "b")))
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    finished = [name for name, kind in log if kind == "final"]
    if share is not None:
        assert finished[0] == "b", finished
    else:
        assert finished.index("b") > finished.index("a0"), finished
    assert results[-1] == reference_tokens(runtime.loaded, plan_b, GREEDY)
    assert engine.scheduler.memory.used_bytes == 0


def test_admission_waits_while_an_encoding_claims_memory():
    runtime = _runtime()
    scheduler = Scheduler(EngineConfig(prefix=None), runtime.module_encoder, PrefixReuse(None))
    scheduler.add(Request("r0", _text_plan(runtime, TEXTS[0]), GREEDY, None, tenant="a"))
    scheduler.kv.claims.add("b")  # b's next module encoding waits for room: nobody overtakes it
    assert not scheduler.schedule().batch and len(scheduler.waiting) == 1
    scheduler.kv.claims.clear()
    assert [s.seq.request.request_id for s in scheduler.schedule().batch] == ["r0"]

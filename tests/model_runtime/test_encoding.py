"""The encode queue alone, with a tiny model's runner: owners served round-robin a chunk at a time (their blocks
equal to one-pass encodings), identical encodings merged, and the KV budget: a job past its owner's share waits while
another owner's runs, one lacking room claims it, one larger than the budget fails."""

from __future__ import annotations

import asyncio

import pytest
import torch

from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.engine import Engine, EngineConfig
from promptcache.model_runtime.engine.encoding import EncodeQueue, ParkedEncodes, encode_now
from promptcache.model_runtime.engine.kv_budget import KVBudget
from promptcache.model_runtime.engine.request import Request
from promptcache.model_runtime.engine.reuse_plan import resolve
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.engine.step_plan import EncodeNeed, ScheduledSeq, StepPlan
from promptcache.model_runtime.errors import InvalidRequestError
from tests.conftest import make_tiny_runtime
from tests.model_runtime.oracles import reference_tokens
from tests.model_runtime.test_engine import SCHEMA

CHUNK = 4  # tokens a step gives encoding: every job here takes several steps


def _setup(budget: KVBudget | None = None):
    runtime = make_tiny_runtime("llama")
    schema = runtime.parse_schema(SCHEMA)
    runtime.add_schema(schema, encode=False)
    encoder = runtime.module_encoder
    return runtime, schema, EncodeQueue(encoder, budget), ModelRunner(runtime.loaded)


def _step(queue: EncodeQueue, runner: ModelRunner) -> ScheduledSeq | None:
    chunk = queue.next_chunk(CHUNK)
    if chunk is not None:
        queue.after_run(chunk, runner.run(StepPlan((), 0, encoding=chunk)))
    return chunk


def test_owners_take_turns_a_chunk_at_a_time_and_encode_what_one_pass_would():
    runtime, schema, queue, runner = _setup()
    jobs = runtime.module_encoder.schema_jobs(schema, predecessors=False)
    flood = [queue.submit(schema, sid, ctx, "salt-a", owner="a") for sid, ctx in jobs]
    late = queue.submit(schema, *jobs[-1], "salt-b", owner="b")
    num_late_chunks = -(-len(runtime.module_encoder.plan(schema, *jobs[-1], "salt-b", owner="b").token_ids) // CHUNK)
    num_steps = 0
    while not late.done.done():
        assert _step(queue, runner) is not None
        num_steps += 1
    # b's chunks alternate with a's: one FIFO would have run every chunk of a's whole schema first
    assert num_steps <= 2 * num_late_chunks, (num_steps, num_late_chunks)
    assert not all(job.done.done() for job in flood)
    while _step(queue, runner) is not None:
        pass
    assert not queue.has_work
    alone = make_tiny_runtime("llama")  # the same jobs, one pass each, on a store of its own
    alone.add_schema(alone.parse_schema(SCHEMA), encode=False)
    encode_now(alone.module_encoder, ModelRunner(alone.loaded), schema, jobs, "salt-a")
    computed = [job for job in flood if job.done.result() is not None]  # None: an earlier job stored it
    assert computed
    for job in computed:
        expected, _ = alone.module_encoder.store.get(job.target)
        torch.testing.assert_close(job.done.result().keys, expected.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(job.done.result().values, expected.values, rtol=1e-4, atol=1e-5)


def test_identical_encodings_are_one_job_that_settles_every_request_waiting_for_it():
    runtime, _, queue, runner = _setup()
    parked = ParkedEncodes(queue)
    plan = runtime.plan('<prompt schema="lib"><user><d2/>Why?</user><assistant/></prompt>')
    requests = [Request(f"r{i}", plan, SamplingParams(), "salt", tenant="a") for i in range(2)]
    use = resolve(plan, EngineConfig().fidelity).uses[0]
    submitted = []
    submit = queue.submit

    def counted(*args, **kwargs):
        submitted.append(submit(*args, **kwargs))
        return submitted[-1]

    queue.submit = counted
    for request in requests:  # parked at two steps
        parked.submit([EncodeNeed(request, use.cached.segment.segment_id, tuple(use.cached.context_ids))])
    assert len(submitted) == 2 and submitted[0] is submitted[1]  # one job for both
    while _step(queue, runner) is not None:
        pass
    assert sorted((r.request_id, error) for r, error in parked.settled()) == [("r0", None), ("r1", None)]
    block = submitted[0].done.result()
    assert block is not None and all(r.computed_kv[submitted[0].target] is block for r in requests)


def test_a_job_past_its_owners_share_waits_while_another_owners_job_runs():
    budget = KVBudget(max_bytes=1 << 30, share=0.5)
    runtime, schema, queue, runner = _setup(budget)
    budget.reserve("a", 600 << 20, {})  # a's running requests already hold more than half
    sid, ctx = runtime.module_encoder.schema_jobs(schema, predecessors=False)[0]
    held = queue.submit(schema, sid, ctx, "salt-a", owner="a")
    served = queue.submit(schema, sid, ctx, "salt-b", owner="b")
    while not served.done.done():
        assert _step(queue, runner) is not None
    assert not held.done.done() and budget.held_bytes("b") == 0  # b's job freed its KV when it ended
    budget.waiting_tenants = {"c"}  # c's requests wait: a stays within its share
    assert _step(queue, runner) is None and not budget.claims  # a waits for its own requests to end, not for room
    budget.waiting_tenants = set()  # nobody else waits: a may use the whole budget
    while not held.done.done():
        assert _step(queue, runner) is not None
    budget.release("a", 600 << 20, {})
    assert budget.memory.used_bytes == 0


def test_a_job_lacking_room_claims_it_and_one_larger_than_the_budget_fails():
    budget = KVBudget(max_bytes=1 << 20)
    runtime, schema, queue, runner = _setup(budget)
    sid, ctx = runtime.module_encoder.schema_jobs(schema, predecessors=False)[0]
    budget.reserve("x", (1 << 20) - 10, {})  # another tenant's requests hold all but 10 bytes
    job = queue.submit(schema, sid, ctx, "salt-a", owner="a")
    assert _step(queue, runner) is None and budget.claims == {"a"}  # admission waits for it meanwhile
    budget.release("x", (1 << 20) - 10, {})
    while not job.done.done():
        assert _step(queue, runner) is not None
    assert not budget.claims and budget.memory.used_bytes == 0
    tiny_budget = KVBudget(max_bytes=10)
    _, schema, queue, runner = _setup(tiny_budget)
    never = queue.submit(schema, sid, ctx, "salt-a", owner="a")
    assert _step(queue, runner) is None
    with pytest.raises(InvalidRequestError, match="budget is 10"):
        never.done.result()
    assert not queue.has_work


def test_a_tenants_upload_does_not_hold_back_another_tenants_request_waiting_for_its_module():
    runtime = make_tiny_runtime("llama")
    schema = runtime.parse_schema(SCHEMA)
    runtime.add_schema(schema, encode=False)
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None, max_prefill_tokens=2 * CHUNK,
                                                         max_prefill_tokens_alone=2 * CHUNK))
    plan = runtime.plan('<prompt schema="lib"><user><d4/>Why?</user><assistant/></prompt>')
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    async def main():
        with engine.inbox.wakeup:  # the upload's jobs are queued first, then b's request parks on d4
            upload = engine.encode_schema(schema, "salt-a", owner="a")
            events = engine.submit(plan, params, cache_salt="salt-b", tenant="b")
        tokens = [event.token_id async for event in events if event.token_id is not None]
        return tokens, upload.done(), await asyncio.wrap_future(upload)

    try:
        tokens, was_upload_done, report = asyncio.run(main())
    finally:
        engine.stop()
    assert not was_upload_done  # one FIFO ran the whole upload first
    assert report.num_segments > 1
    assert tokens == reference_tokens(runtime.loaded, plan, params)

"""Many requests over one schema: every result equals a fresh computation; each module encoded once."""

from __future__ import annotations

import asyncio
import random

from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.engine import Engine, EngineConfig
from tests.conftest import make_tiny_runtime
from tests.model_runtime.engine_probe import engine_tokens, first_step
from tests.model_runtime.oracles import reference_tokens

SCHEMA = """<schema name="lib">Library preface.
  <module name="d0">Zero: cats sleep most of the day.</module>
  <module name="d1">One: tea is brewed with hot water.</module>
  <module name="d2">Two: Rome was not built in a day.</module>
  <module name="d3">Three: the moon orbits the earth.</module>
  <module name="d4">Four: bees make honey from nectar.</module>
  <module name="d5">Five: rivers flow to the sea.</module>
</schema>"""


async def _serve(engine: Engine, plan, params: SamplingParams):
    tokens, final = [], None
    async for event in engine.submit(plan, params):
        assert event.report is None or event.report.error is None, event.report
        tokens += [event.token_id] if event.token_id is not None else []
        final = event
    return tokens, final


def test_fifty_mixed_requests_match_fresh_runs_and_encode_each_module_once():
    rng = random.Random(7)
    runtime = make_tiny_runtime("qwen2")
    report = runtime.add_schema(runtime.parse_schema(SCHEMA))
    assert report.num_encoded == 7  # the preface and six documents, each exactly once
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None))
    try:
        for i in range(50):
            docs = rng.sample([f"d{k}" for k in range(6)], rng.randint(1, 4))
            prompt = f'<prompt schema="lib">{"".join(f"<{d}/>" for d in docs)}Question {i}?</prompt>'
            tokens, final = asyncio.run(_serve(engine, runtime.plan(prompt), params))
            assert all(m.tier == "device" for m in final.report.cache.modules)
            assert final.report.usage.cached_tokens > 0 and final.report.usage.computed_tokens > 0
            if i % 10 == 0:  # a fresh runtime (empty store) computes everything again: same answer
                fresh = make_tiny_runtime("qwen2")
                fresh.add_schema(fresh.parse_schema(SCHEMA), encode=False)
                fresh_plan = fresh.plan(prompt)
                assert tokens == engine_tokens(fresh, fresh_plan, params)
                assert tokens == reference_tokens(fresh.loaded, fresh_plan, params)
                a = first_step(runtime, runtime.plan(prompt))[0]
                b = first_step(fresh, fresh_plan)[0]
                assert (a - b).abs().max().item() <= 1e-5
    finally:
        engine.stop()
    assert runtime.module_encoder.num_encoded_segments == 7


def test_missing_kv_is_encoded_on_demand_and_reported():
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA), encode=False)
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None))
    plan = runtime.plan('<prompt schema="lib"><d2/>Q</prompt>')
    params = SamplingParams(max_tokens=1)
    try:
        _, first = asyncio.run(_serve(engine, plan, params))
        _, again = asyncio.run(_serve(engine, runtime.plan('<prompt schema="lib"><d2/>Q</prompt>'), params))
    finally:
        engine.stop()
    assert [m.tier for m in first.report.cache.modules] == ["computed"]
    assert first.report.timings.encode_ms > 0
    assert [m.tier for m in again.report.cache.modules] == ["device"] and again.report.timings.encode_ms == 0


def test_module_kv_whose_fetch_is_refused_is_encoded_in_engine_steps(monkeypatch):
    """A tier holds d2's KV, but fetching it is refused (the fetch policy measured recomputing as
    faster): the request waits while the engine recomputes it in chunks between steps, never inline,
    and is served from that KV, reported as computed."""
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    encoder, store = runtime.module_encoder, runtime.module_encoder.store
    plan = runtime.plan('<prompt schema="lib"><d2/>Q</prompt>')
    [d2] = [c for c in plan.cached if c.segment.owner == "d2"]
    d2_key = encoder.key(plan.schema, d2.segment.segment_id, d2.context_ids, None)
    get, refused = store.get, []

    def policy_get(key, **kwargs):
        if key == d2_key and kwargs.get("nbytes") is not None and not refused:  # a fetch the policy judges
            refused.append(key)
            return None
        return get(key, **kwargs)

    monkeypatch.setattr(store, "get", policy_get)
    engine = Engine(encoder, EngineConfig(prefix=None, max_prefill_tokens=4, max_prefill_tokens_alone=4))
    queued, submit = [], engine.encodes.submit
    engine.encodes.submit = lambda *a, **k: queued.append(k.get("recompute")) or submit(*a, **k)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    before = encoder.num_encoded_segments
    try:
        tokens, final = asyncio.run(_serve(engine, plan, params))
    finally:
        engine.stop()
    assert refused == [d2_key] and queued == [True]  # queued for the encode queue, recomputed though stored
    assert encoder.num_encoded_segments == before + 1
    assert engine.num_steps > len(d2.segment.token_ids) // 4  # in chunks of 4 tokens
    assert [(m.path, m.tier) for m in final.report.cache.modules] == [("d2", "computed")]
    assert final.report.timings.encode_ms > 0
    assert tokens == reference_tokens(runtime.loaded, plan, params)

"""Many requests over one schema: every result equals a fresh computation; each module encoded once."""

from __future__ import annotations

import random

from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.cached_prefill import prefill
from tests.conftest import make_tiny_runtime

SCHEMA = """<schema name="lib">Library preface.
  <module name="d0">Zero: cats sleep most of the day.</module>
  <module name="d1">One: tea is brewed with hot water.</module>
  <module name="d2">Two: Rome was not built in a day.</module>
  <module name="d3">Three: the moon orbits the earth.</module>
  <module name="d4">Four: bees make honey from nectar.</module>
  <module name="d5">Five: rivers flow to the sea.</module>
</schema>"""


def test_fifty_mixed_requests_match_fresh_runs_and_encode_each_module_once():
    rng = random.Random(7)
    runtime = make_tiny_runtime("qwen2")
    report = runtime.add_schema(runtime.parse_schema(SCHEMA))
    assert report.num_encoded == 7  # the preface and six documents, each exactly once
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i in range(50):
        docs = rng.sample([f"d{k}" for k in range(6)], rng.randint(1, 4))
        prompt = f'<prompt schema="lib">{"".join(f"<{d}/>" for d in docs)}Question {i}?</prompt>'
        result = runtime.generate(runtime.plan(prompt), params)
        assert all(m.tier == "device" for m in result.modules)
        assert result.usage.cached_tokens > 0 and result.usage.computed_tokens > 0
        if i % 10 == 0:  # a fresh runtime (empty store) computes everything again: same answer
            fresh = make_tiny_runtime("qwen2")
            fresh.add_schema(fresh.parse_schema(SCHEMA), encode=False)
            fresh_plan = fresh.plan(prompt)
            expected = fresh.generate(fresh_plan, params)
            assert result.token_ids == expected.token_ids
            a = prefill(runtime.module_encoder, runtime.plan(prompt)).logits
            b = prefill(fresh.module_encoder, fresh_plan).logits
            assert (a - b).abs().max().item() <= 1e-5
    assert runtime.module_encoder.num_encoded_segments == 7


def test_missing_kv_is_encoded_on_demand_and_reported():
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA), encode=False)
    result = runtime.generate(runtime.plan('<prompt schema="lib"><d2/>Q</prompt>'), SamplingParams(max_tokens=1))
    assert [m.tier for m in result.modules] == ["computed"]
    assert result.timings.encode_ms > 0
    again = runtime.generate(runtime.plan('<prompt schema="lib"><d2/>Q</prompt>'), SamplingParams(max_tokens=1))
    assert [m.tier for m in again.modules] == ["device"] and again.timings.encode_ms == 0

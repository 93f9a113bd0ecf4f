"""Prompt spans on the engine's final event, checked against oracles: the plan's own tokens and positions
(every prompt token exactly once), the ReusePlan's stream (what is not module KV, in order), the usage
and module/prefix reports, and the fidelity mode's recomputed count."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import pytest

from promptcache.cache_store import BlockIndexConfig, StoreConfig, build_store
from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.engine import Engine, EngineConfig, Fidelity, resolve
from promptcache.pml import token_plan
from tests.conftest import make_tiny_runtime
from tests.model_runtime.test_exactness import APPROX_PROMPTS, APPROX_SCHEMA
from tests.model_runtime.test_fidelity import PROMPTS, SCHEMA

MODES = [Fidelity("fast"), Fidelity("balanced", 2), Fidelity("balanced", 5), Fidelity("exact")]
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
TIERS = {"device", "host", "redis", "disk"}
FAST = Fidelity("fast")


class Harness:
    def __init__(self, *, block_size: int | None = 4, store=None, **engine) -> None:
        self.runtime = make_tiny_runtime("llama", store=store)
        self.runtime.add_schema(self.runtime.parse_schema(SCHEMA))
        self.runtime.add_schema(self.runtime.parse_schema(APPROX_SCHEMA.format(params="placeholder")))
        self.runtime.add_schema(self.runtime.parse_schema('<schema name="plain"/>'), encode=False)
        prefix = BlockIndexConfig(block_size=block_size) if block_size else None
        self.engine = Engine(self.runtime.module_encoder, EngineConfig(prefix=prefix, **engine))

    def run(self, plan, fidelity: Fidelity = FAST, params: SamplingParams = GREEDY, *, report_spans: bool = True):
        async def go():
            final = None
            async for event in self.engine.submit(plan, params, fidelity=fidelity, report_spans=report_spans):
                assert event.report is None or event.report.error is None, event.report
                if event.report is not None:
                    final = event
            return final

        return asyncio.run(go())


@pytest.fixture
def harness(engines):
    return lambda **kwargs: engines(Harness, **kwargs)


def _tokens(spans, origin: str | None = None) -> int:
    return sum(s.num_tokens for s in spans if origin is None or s.origin == origin)


def check_spans(plan, fidelity: Fidelity, final) -> None:
    """Every invariant a span report must satisfy, against the plan, the ReusePlan and the final event."""
    spans = final.report.cache.spans
    assert spans, "an admitted request reports its spans"
    assert [s.start for s in spans] == sorted(s.start for s in spans)
    positions = [p for s in spans for p in range(s.start, s.end)]
    assert positions == plan.position_ids()  # every prompt position once, in order
    assert [t for s in spans for t in s.token_ids] == plan.token_ids()
    for a, b in itertools.pairwise(spans):  # merged: no two touching spans with the same key
        assert a.end != b.start or (a.origin, a.module, a.tier) != (b.origin, b.module, b.tier)
    for s in spans:
        assert s.num_tokens > 0 and s.origin in ("module", "prefix", "recomputed", "computed")
        assert (s.tier in TIERS) if s.origin in ("module", "prefix") else s.tier is None
    # What is not module KV is the stream the ReusePlan computes (or reuses through prefix blocks), in order.
    reuse = resolve(plan, fidelity)
    stream = [t for s in spans if s.origin != "module" for t in s.token_ids]
    assert stream == list(reuse.token_ids)
    reused = final.report.cache.prefix.num_tokens if final.report.cache.prefix is not None else 0
    assert [s.origin for s in spans if s.origin != "module" for _ in s.token_ids][:reused] == ["prefix"] * reused
    # Totals agree with usage and the module / prefix reports.
    usage = final.report.usage
    assert _tokens(spans) == usage.prompt_tokens
    assert _tokens(spans, "module") + _tokens(spans, "prefix") == usage.cached_tokens
    assert _tokens(spans, "recomputed") + _tokens(spans, "computed") == usage.computed_tokens
    assert _tokens(spans, "prefix") == reused
    by_module = Counter()
    for s in spans:
        if s.origin == "module":
            by_module[s.module or ""] += s.num_tokens
    modules = final.report.cache.modules
    assert {m.path: m.num_tokens for m in modules if m.num_tokens} == {k: v for k, v in by_module.items() if k}


@pytest.mark.parametrize("fidelity", MODES, ids=lambda f: f"{f.mode}-{f.head_tokens}")
def test_spans_cover_the_plan_in_every_mode_first_and_repeated(harness, fidelity):
    h = harness(block_size=4)
    for prompt in [*PROMPTS, *APPROX_PROMPTS]:
        plan = h.runtime.plan(prompt)
        first = h.run(plan, fidelity)
        check_spans(plan, fidelity, first)
        assert _tokens(first.report.cache.spans, "prefix") == 0
        # nothing stored yet
        assert _tokens(first.report.cache.spans, "recomputed") == first.report.usage.recomputed_tokens
        again = h.run(plan, fidelity)
        check_spans(plan, fidelity, again)
        assert _tokens(again.report.cache.spans, "prefix") > 0  # the repeat reuses the stream's blocks
        # ... recomputed ones included: it reports only what it recomputed itself
        recomputed = _tokens(again.report.cache.spans, "recomputed")
        assert recomputed == again.report.usage.recomputed_tokens < max(1, first.report.usage.recomputed_tokens)
        assert sum(m.num_recomputed for m in again.report.cache.modules) == again.report.usage.recomputed_tokens


def test_first_run_modules_from_device_then_a_repeat_reuses_its_text_as_prefix(harness):
    h = harness(block_size=4, logits_cache_bytes=1 << 20)
    plan = h.runtime.plan(PROMPTS[1])  # d0, d1, then a question
    first = h.run(plan)
    modules = [s for s in first.report.cache.spans if s.origin == "module"]
    assert {s.module for s in modules} >= {"d0", "d1"} and {s.tier for s in modules} == {"device"}
    question = [s for s in first.report.cache.spans if s.origin == "computed"]
    assert question and all(s.module is None for s in question)
    assert _tokens(first.report.cache.spans, "computed") == plan.num_new_tokens
    again = h.run(plan)
    assert [s.origin for s in again.report.cache.spans if s.origin != "module"] == ["prefix"]  # logits cached: no pass
    assert {s.tier for s in again.report.cache.spans if s.origin == "prefix"} == {"device"}
    assert [(s.start, s.module, s.tier) for s in again.report.cache.spans if s.origin == "module"] == \
        [(s.start, s.module, s.tier) for s in modules]


def test_spans_are_built_only_when_asked(harness):
    h = harness()
    plan = h.runtime.plan(PROMPTS[1])
    assert h.run(plan, report_spans=False).report.cache.spans is None
    check_spans(plan, FAST, h.run(plan))


@pytest.mark.parametrize("fidelity", [Fidelity("balanced", 3), Fidelity("exact")], ids=["balanced", "exact"])
def test_recomputed_spans_are_the_modes_recomputed_tokens(harness, fidelity):
    h = harness(block_size=None)  # no prefix reuse: every stream token is computed on every run
    plan = h.runtime.plan(PROMPTS[0])  # d2 before d0: d0 is out of context
    final = h.run(plan, fidelity)
    check_spans(plan, fidelity, final)
    recomputed = Counter()
    for s in final.report.cache.spans:
        if s.origin == "recomputed":
            recomputed[s.module] += s.num_tokens
    assert final.report.usage.recomputed_tokens > 0
    assert sum(recomputed.values()) == final.report.usage.recomputed_tokens
    assert dict(recomputed) == {m.path: m.num_recomputed for m in final.report.cache.modules if m.num_recomputed}


def test_arguments_and_the_last_token_computed_for_its_logits(harness):
    h = harness(block_size=None)
    plan = h.runtime.plan(APPROX_PROMPTS[0])  # <trip days="3"><paris/></trip><last/>What now?
    final = h.run(plan)
    check_spans(plan, Fidelity("fast"), final)
    argument = [s for s in final.report.cache.spans if s.origin == "computed" and s.module == "trip"]
    assert argument and argument[0].start == h.runtime.get_schema("approx").modules["trip"].params["days"].start
    only_modules = h.runtime.plan('<prompt schema="lib"><d0/></prompt>')  # nothing new: last token recomputed
    final = h.run(only_modules)
    check_spans(only_modules, Fidelity("fast"), final)
    assert final.report.cache.spans[-1].origin == "computed" and final.report.cache.spans[-1].num_tokens == 1
    last = max(only_modules.cached, key=lambda c: c.segment.end).segment  # its owner: "" (role markup)
    assert final.report.cache.spans[-1].module == (last.owner or None) and final.report.usage.recomputed_tokens == 0


def test_plain_prompts_and_module_kv_from_a_slower_tier(harness):
    runtime = make_tiny_runtime("llama")
    per_token = runtime.loaded.kv_bytes_per_token
    store = build_store(StoreConfig(device_max_bytes=40 * per_token, host_max_bytes=1 << 30))
    h = harness(block_size=4, store=store, logits_cache_bytes=0)
    tokenizer = h.runtime.loaded.tokenizer
    plain = token_plan(h.runtime.get_schema("plain"), tuple(tokenizer.encode("Cats sleep most of the day and dream.")))
    first, again = h.run(plain), h.run(plain)
    assert [s.origin for s in first.report.cache.spans] == ["computed"]
    check_spans(plain, Fidelity("fast"), again)  # blocks from the device and host tiers: one span per tier
    spans = again.report.cache.spans
    assert {s.origin for s in spans[:-1]} == {"prefix"} and spans[-1].origin == "computed"
    assert spans[-1].num_tokens == 1
    # The lib schema's modules no longer fit the device budget: some come back from the host tier.
    plan = h.runtime.plan(PROMPTS[1])
    final = h.run(plan)
    check_spans(plan, Fidelity("fast"), final)
    assert {s.tier for s in final.report.cache.spans if s.origin == "module"} & {"host"}

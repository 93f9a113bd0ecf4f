"""Fidelity context "predecessor": out-of-context modules reuse a second encoding, computed after the
module before them in the schema, against oracles: a full prefill where that makes the prompt's KV
exact, the explicit-mask oracle elsewhere (test_fidelity.py runs every mode through it), and the
stored first encoding never touched."""

from __future__ import annotations

import asyncio

import torch

from promptcache.cache_store import MemoryTier, TieredStore
from promptcache.model_runtime.baseline import full_prefill_greedy, full_prefill_logits
from promptcache.model_runtime.engine import Engine, EngineConfig, Fidelity, resolve
from promptcache.model_runtime.engine.reuse_plan import in_context
from tests.conftest import make_tiny_runtime
from tests.model_runtime.engine_probe import first_step
from tests.model_runtime.test_fidelity import PROMPTS, SCHEMA, _runtime, _tokens

PRECEDED = Fidelity("fast", context="predecessor")


def test_consecutive_modules_become_a_full_prefill():
    """d0 then d1: d1's second encoding is computed after d0, exactly what precedes it in the prompt, so
    the request's KV is a full prefill's; the schema's encoding of d1 (without d0) is not."""
    runtime = _runtime("llama")
    plan = runtime.plan(PROMPTS[1])
    assert not plan.is_exact  # d1 was encoded without d0 before it
    reference = full_prefill_logits(runtime.loaded.model, plan.token_ids(), list(plan.position_ids()))[-1]
    reuse = resolve(plan, PRECEDED)
    assert reuse.context == "predecessor" and all(in_context(plan, u.cached) for u in reuse.uses)
    assert not all(in_context(plan, c) for c in plan.cached)  # with the schema's encodings d1 is not
    assert resolve(plan, Fidelity("balanced", 4, context="predecessor")).num_recomputed == 0  # d1 is in context
    preceded, final = first_step(runtime, plan, PRECEDED)
    assert (preceded - reference).abs().max().item() <= 1e-4
    assert {m.path: m.encoded_after for m in final.report.cache.modules} == {"d0": None, "d1": "d0"}
    schema_context, _ = first_step(runtime, plan, Fidelity("fast"))
    assert (schema_context - reference).abs().max().item() > 1e-3  # what the second encoding fixes


def test_second_encoding_is_stored_apart_and_the_first_never_changes():
    runtime = _runtime("llama")
    encoder, store = runtime.module_encoder, runtime.module_encoder.store
    plan = runtime.plan(PROMPTS[0])  # layout order d0, d2: d2's predecessor in the schema is d1
    first_keys = [encoder.key(plan.schema, c.segment.segment_id, c.context_ids, None) for c in plan.cached]
    before = [store.get(k)[0].keys.clone() for k in first_keys]
    reuse = resolve(plan, Fidelity("balanced", 2, "contiguous", "predecessor"))
    assert reuse.encoded_after(plan.schema) == {"d2": "d1"}  # d0 has no module before it: its own encoding
    second = [encoder.key(plan.schema, u.cached.segment.segment_id, u.cached.context_ids, None)
              for u in reuse.uses if u.cached.segment.owner == "d2"]
    assert second and all(store.tier_of(k) is None for k in second) and set(second).isdisjoint(first_keys)
    engine = Engine(encoder, EngineConfig(prefix=None))
    try:
        asyncio.run(_tokens(engine, plan, fidelity=Fidelity("balanced", 2, "contiguous", "predecessor")))
    finally:
        engine.stop()
    assert all(store.tier_of(k) is not None for k in second)  # the engine encoded it on first use, kept
    _, final = first_step(runtime, plan, Fidelity("balanced", 2, "contiguous", "predecessor"))
    cache = final.report.cache
    assert cache.context == "predecessor" and {m.path: m.encoded_after for m in cache.modules} == {"d0": None,
                                                                                                  "d2": "d1"}
    for key, old in zip(first_keys, before):
        assert torch.equal(store.get(key)[0].keys, old)


def test_exact_mode_and_exact_prompts_ignore_the_context():
    runtime = _runtime("llama")
    for prompt in PROMPTS:
        plan = runtime.plan(prompt)
        assert resolve(plan, Fidelity("exact", context="predecessor")) == resolve(plan, Fidelity("exact"))
    exact_prompt = runtime.plan(PROMPTS[2])  # d3 alone: in its encoding context
    assert exact_prompt.is_exact and resolve(exact_prompt, PRECEDED).context == "schema"


def _fresh_runtime(store=None):
    """The lib schema parsed, nothing encoded yet (`store`: a store of the test's own)."""
    runtime = make_tiny_runtime("llama", store=store)
    schema = runtime.parse_schema(SCHEMA)
    runtime.add_schema(schema, encode=False)
    return runtime, schema


def _second_keys(runtime, plan) -> list[str]:
    reuse = resolve(plan, PRECEDED)
    return [runtime.module_encoder.key(plan.schema, u.cached.segment.segment_id, u.cached.context_ids, None)
            for u in reuse.uses if u.cached.context_ids != u.cached.segment.context_ids]


def test_an_upload_leaves_second_encodings_to_their_first_use():
    """An engine whose requests reuse second encodings does not make them at upload: the first request
    that needs one parks while the engine's chunked encode queue makes it (nothing is encoded inline
    when the request is assembled), and its answer is a full prefill's (d0 then d1: exact with d1's
    second encoding). `second_encodings=True` makes them at upload instead."""
    runtime, schema = _fresh_runtime()
    encoder = runtime.module_encoder
    jobs, preceded = encoder.schema_jobs(schema), encoder.schema_jobs(schema, predecessors=True)
    assert len(preceded) == len(jobs) + 3  # d1, d2, d3 after the module before each; d0 has none
    plan = runtime.plan(PROMPTS[1])
    second = _second_keys(runtime, plan)
    assert len(second) == 1  # d1 after d0
    engine = Engine(encoder, EngineConfig(prefix=None, fidelity=PRECEDED, max_prefill_tokens=4,
                                          max_prefill_tokens_alone=4))
    queued, fetched = [], []
    submit, fetch = engine.encodes.submit, encoder.fetch
    engine.encodes.submit = lambda *a, **k: queued.append(encoder.key(*a[:3], a[3])) or submit(*a, **k)
    encoder.fetch = lambda *a, **k: fetched.append(fetch(*a, **k)) or fetched[-1]
    try:
        report = engine.encode_schema(schema).result(timeout=120)
        assert (report.num_segments, report.num_encoded) == (len(jobs), len(jobs))
        assert encoder.store.tier_of(second[0]) is None  # not made at upload
        steps = engine.num_steps
        tokens = asyncio.run(_tokens(engine, plan, fidelity=PRECEDED))
        assert second[0] in queued[len(jobs):]  # through the chunked encode queue, on first use
        assert engine.num_steps - steps > len(schema.segments_of("d1")[0].token_ids) // 4  # in chunks of 4
        assert fetched and None not in fetched  # stored before assembly: nothing left to encode inline
        assert encoder.store.tier_of(second[0]) is not None
    finally:
        engine.stop()
    model = runtime.loaded.model
    assert tokens == full_prefill_greedy(model, plan.token_ids(), list(plan.position_ids()), len(tokens))

    runtime, schema = _fresh_runtime()
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None))
    try:
        report = engine.encode_schema(schema, second_encodings=True).result(timeout=120)
    finally:
        engine.stop()
    assert (report.num_segments, report.num_encoded) == (len(preceded), len(preceded))
    assert runtime.module_encoder.store.tier_of(_second_keys(runtime, runtime.plan(PROMPTS[1]))[0]) is not None


def test_second_encodings_are_evicted_before_first_encodings():
    """Under the tier's byte budget a new second encoding evicts an older second encoding, never a first
    encoding (even one used less recently, which plain LRU would take); the evicted one is made again on
    its next use, and the answer is still the full prefill's."""
    tier = MemoryTier("device", 1 << 30)
    runtime, schema = _fresh_runtime(TieredStore([tier]))
    encoder, model = runtime.module_encoder, runtime.loaded.model
    engine = Engine(encoder, EngineConfig(prefix=None, fidelity=PRECEDED))
    consecutive, other = runtime.plan(PROMPTS[1]), runtime.plan(PROMPTS[0])  # d0 d1 | d2 d0
    [d1_second], [d2_second] = _second_keys(runtime, consecutive), _second_keys(runtime, other)
    try:
        engine.encode_schema(schema).result(timeout=120)
        first = list(tier.keys())
        first_tokens = asyncio.run(_tokens(engine, consecutive, fidelity=PRECEDED))
        assert tier.lookup(d1_second).kind == "prefix" and all(tier.lookup(k).kind == "module" for k in first)
        for key in first[1:]:  # first[0] is now the least recently used entry
            tier.touch(key)
        d2_bytes = tier.lookup(encoder.key(schema, schema.segments_of("d2")[0].segment_id,
                                           schema.segments_of("d2")[0].context_ids, None)).block.nbytes
        tier.max_bytes = tier.used_bytes + d2_bytes - 1  # room for d2's second encoding once one entry goes
        asyncio.run(_tokens(engine, other, fidelity=PRECEDED))
        assert tier.contains(d2_second) and not tier.contains(d1_second)
        assert all(tier.contains(k) for k in first)  # every first encoding kept, the LRU one included
        again = asyncio.run(_tokens(engine, consecutive, fidelity=PRECEDED))  # d1's made again, d2's goes
        assert tier.contains(d1_second) and not tier.contains(d2_second)
        assert all(tier.contains(k) for k in first)
    finally:
        engine.stop()
    reference = full_prefill_greedy(model, consecutive.token_ids(), list(consecutive.position_ids()), len(again))
    assert first_tokens == again == reference


def test_predecessor_is_the_module_before_when_its_own_context_fits():
    runtime = _runtime("llama")

    def owner_after(schema_name: str, module: str) -> str | None:
        schema = runtime.get_schema(schema_name)
        segment = schema.segments_of(module)[0]
        context = schema.predecessor_context(segment.segment_id, segment.context_ids)
        return None if context is None else schema.segments[context[-1]].owner

    assert owner_after("approx", "last") == "extra"  # encoded after the preface like `last`: its KV is the link
    assert owner_after("approx", "extra") is None  # trip's tail was encoded after trip's head and a parameter slot
    assert owner_after("approx", "trip") is None  # nothing but the preface before it
    assert [owner_after("lib", m) for m in ("d0", "d1", "d2", "d3")] == [None, "d0", "d1", "d2"]

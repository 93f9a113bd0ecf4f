"""Fidelity context "predecessor": out-of-context modules reuse a second encoding, computed after the
module before them in the schema, against oracles: a full prefill where that makes the prompt's KV
exact, the explicit-mask oracle elsewhere (test_fidelity.py runs every mode through it), and the
stored first encoding never touched."""

from __future__ import annotations

import asyncio

import torch

from promptcache.model_runtime.baseline import full_prefill_logits
from promptcache.model_runtime.engine import Engine, EngineConfig, Fidelity, resolve
from promptcache.model_runtime.engine.reuse_plan import in_context
from tests.model_runtime.test_fidelity import PROMPTS, _first_logits, _runtime, _tokens

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
    preceded, final = _first_logits(runtime, plan, PRECEDED)
    assert (preceded - reference).abs().max().item() <= 1e-4
    assert {m.path: m.encoded_after for m in final.modules} == {"d0": None, "d1": "d0"}
    schema_context, _ = _first_logits(runtime, plan, Fidelity("fast"))
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
    assert second and all(store.contains(k) is None for k in second) and set(second).isdisjoint(first_keys)
    engine = Engine(encoder, EngineConfig(prefix=None))
    try:
        asyncio.run(_tokens(engine, plan, fidelity=Fidelity("balanced", 2, "contiguous", "predecessor")))
    finally:
        engine.stop()
    assert all(store.contains(k) is not None for k in second)  # the engine encoded it on first use, kept
    _, final = _first_logits(runtime, plan, Fidelity("balanced", 2, "contiguous", "predecessor"))
    assert final.context == "predecessor" and {m.path: m.encoded_after for m in final.modules} == {"d0": None,
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


def test_an_engine_defaulting_to_predecessor_encodes_both_at_upload():
    runtime = _runtime("llama")
    schema = runtime.get_schema("lib")
    jobs = runtime.module_encoder.schema_jobs(schema)
    preceded = runtime.module_encoder.schema_jobs(schema, predecessors=True)
    assert len(preceded) == len(jobs) + 3  # d1, d2, d3 after the module before each; d0 has none
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None, fidelity=PRECEDED))
    try:
        report = engine.encode_schema(schema).result(timeout=120)  # the schema's own encodings are stored
        assert (report.num_segments, report.num_encoded) == (len(preceded), 3)
        encoded = runtime.module_encoder.num_encoded_segments
        asyncio.run(_tokens(engine, runtime.plan(PROMPTS[0]), fidelity=PRECEDED))
        assert runtime.module_encoder.num_encoded_segments == encoded
    finally:
        engine.stop()


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

"""One request never harms another: poison requests among healthy streams, against the HF reference."""

from __future__ import annotations

import asyncio

import pytest

from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.engine import Engine, EngineConfig
from promptcache.model_runtime.sampling import Sampler
from promptcache.pml import token_plan
from tests.conftest import make_tiny_runtime
from tests.model_runtime.oracles import reference_tokens
from tests.model_runtime.test_engine import SCHEMA

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


async def _run(engine: Engine, plan, params=GREEDY):
    tokens, final = [], None
    async for event in engine.submit(plan, params):
        if event.token_id is not None:
            tokens.append(event.token_id)
        if event.report is not None:
            final = event
    return tokens, final


def _setup():
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    runtime.add_schema(runtime.parse_schema('<schema name="plain"/>'), encode=False)
    healthy = [runtime.plan(f'<prompt schema="lib"><user><d{i}/>Question {i}?</user><assistant/></prompt>')
               for i in range(4)]
    expected = [reference_tokens(runtime.loaded, plan, GREEDY) for plan in healthy]
    return runtime, healthy, expected


def test_a_request_that_breaks_the_forward_pass_fails_alone():
    runtime, healthy, expected = _setup()
    vocab = runtime.loaded.model.config.vocab_size
    poison = token_plan(runtime.get_schema("plain"), (5, 6, vocab + 1000))  # an id past the embedding table
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None, max_num_seqs=8))

    async def main():
        tasks = [asyncio.create_task(_run(engine, plan)) for plan in healthy[:2]]
        await asyncio.sleep(0.05)  # the poison joins a batch already decoding
        tasks.append(asyncio.create_task(_run(engine, poison)))
        tasks += [asyncio.create_task(_run(engine, plan)) for plan in healthy[2:]]
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    poisoned = results[2][1]
    assert poisoned.report.error_type == "internal" and "internal error (id " in poisoned.report.error
    assert [r[0] for i, r in enumerate(results) if i != 2] == expected
    assert all(r[1].report.error is None for i, r in enumerate(results) if i != 2)
    assert engine.scheduler.memory.used_bytes == 0 and not engine.scheduler.running


def test_a_failure_while_admitting_fails_that_request_only(monkeypatch):
    runtime, healthy, expected = _setup()
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None))
    fetch = runtime.module_encoder.fetch

    def broken_fetch(schema, segment_id, context_ids, cache_salt=None, *, reach=None):
        if schema.segments[segment_id].owner == "d3":
            raise RuntimeError("disk on fire")
        return fetch(schema, segment_id, context_ids, cache_salt, reach=reach)

    monkeypatch.setattr(runtime.module_encoder, "fetch", broken_fetch)

    async def main():
        return await asyncio.gather(*[_run(engine, plan) for plan in healthy])

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    assert results[3][1].report.error_type == "internal" and "disk on fire" not in results[3][1].report.error
    assert [r[0] for r in results[:3]] == expected[:3]
    assert runtime.module_encoder.store.stats().tiers[0].num_referenced == 0  # nothing left acquired


def test_prompt_past_the_model_context_is_a_client_error():
    runtime, healthy, _ = _setup()
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None))
    too_long = token_plan(runtime.get_schema("plain"), tuple([7] * (runtime.loaded.max_positions + 5)))

    async def main():
        return await asyncio.gather(_run(engine, too_long), _run(engine, healthy[0]))

    try:
        (_, bad), (tokens, good) = asyncio.run(main())
    finally:
        engine.stop()
    assert bad.report.error_type == "invalid_request" and "position" in bad.report.error
    assert good.report.error is None and len(tokens) == GREEDY.max_tokens


def test_sampling_refuses_overflowing_inputs():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=1e-40)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    import torch

    sampler = Sampler(SamplingParams(temperature=1.0))
    with pytest.raises(FloatingPointError):
        sampler.sample(torch.tensor([float("nan"), 1.0]))

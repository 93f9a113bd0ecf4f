"""No stop-the-world: long prompts and module encodings advance in chunks between decode steps, and
give the same tokens and KV as doing them in one pass (the HF reference is the oracle)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, SamplingParams
from promptcache.model_runtime.engine import Engine, EngineConfig, Fidelity
from promptcache.pml import token_plan
from tests.conftest import _tiny_loaded, make_tiny_runtime
from tests.model_runtime.oracles import reference_tokens
from tests.model_runtime.test_fidelity import GREEDY, PROMPTS, SCHEMA, _tokens

TEXT = "The quick brown fox jumps over the lazy dog. Cats sleep most of the day. " * 12


def test_long_prompts_prefill_in_chunks_while_others_decode():
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    runtime.add_schema(runtime.parse_schema('<schema name="plain"/>'), encode=False)
    ids = tuple(runtime.loaded.tokenizer.encode(TEXT, add_special_tokens=False))
    long_plan = token_plan(runtime.get_schema("plain"), ids)
    short = [runtime.plan(p) for p in PROMPTS]
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None, max_prefill_tokens=16))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    async def main():
        decoding = [asyncio.create_task(_tokens(engine, plan, params)) for plan in short]
        await asyncio.sleep(0.05)
        steps = engine.num_steps
        long_task = asyncio.create_task(_tokens(engine, long_plan))
        balanced = asyncio.create_task(_tokens(engine, short[0], fidelity=Fidelity("balanced", 3)))
        results = await asyncio.gather(*decoding, long_task, balanced)
        return results, engine.num_steps - steps

    try:
        results, steps = asyncio.run(main())
    finally:
        engine.stop()
    assert results[:3] == [reference_tokens(runtime.loaded, plan, params) for plan in short]
    assert results[3] == reference_tokens(runtime.loaded, long_plan, GREEDY)
    assert len(ids) > 16 * 8 and steps >= len(ids) // 16  # the long prompt took many small steps
    alone = Engine(runtime.module_encoder, EngineConfig(prefix=None))
    try:  # chunked balanced prefill (row offsets across chunks) == balanced in one pass
        assert results[4] == asyncio.run(_tokens(alone, short[0], fidelity=Fidelity("balanced", 3)))
    finally:
        alone.stop()


def test_schema_and_missing_modules_encode_in_engine_steps_with_the_same_kv():
    loaded = _tiny_loaded("llama", torch.float32)
    reference = ModelRuntime(loaded, build_store(StoreConfig()))
    reference.add_schema(reference.parse_schema(SCHEMA))  # encoded in one pass each
    runtime = ModelRuntime(loaded, build_store(StoreConfig()))
    schema = runtime.parse_schema(SCHEMA)
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None, max_prefill_tokens=4,
                                                         max_prefill_tokens_alone=8))
    try:
        report = engine.encode_schema(schema).result(timeout=60)
        assert report.num_encoded > 0 and engine.num_steps > report.num_encoded  # several chunks each
        runtime.add_schema(schema, encode=False)
        for segment_id, context_ids in runtime.module_encoder.schema_jobs(schema):
            key = runtime.module_encoder.key(schema, segment_id, context_ids, None)
            ours, theirs = runtime.module_encoder.store.get(key)[0], reference.module_encoder.store.get(key)[0]
            assert (ours.keys - theirs.keys).abs().max() <= 1e-5
        # A salt no tier has: the request's modules are encoded in chunks before it is admitted.
        plan = runtime.plan(PROMPTS[0])
        before = runtime.module_encoder.num_encoded_segments

        async def salted():
            tokens = []
            async for event in engine.submit(plan, GREEDY, cache_salt="new-tenant"):
                assert event.report is None or event.report.error is None, event.report
                tokens += [event.token_id] if event.token_id is not None else []
            return tokens

        assert asyncio.run(salted()) == reference_tokens(loaded, plan, GREEDY)
        assert runtime.module_encoder.num_encoded_segments > before
    finally:
        engine.stop()


def _encode_while_decoding(fail_fused_once: bool):
    """Upload SCHEMA while 3 prompts decode; returns (decoded tokens, their oracle, max KV difference
    against a one-pass encoding, number of forward passes, number of steps)."""
    loaded = _tiny_loaded("llama", torch.float32)
    reference = ModelRuntime(loaded, build_store(StoreConfig()))
    reference.add_schema(reference.parse_schema(SCHEMA))
    runtime = ModelRuntime(loaded, build_store(StoreConfig()))
    runtime.add_schema(runtime.parse_schema('<schema name="plain"/>'), encode=False)
    plans = [token_plan(runtime.get_schema("plain"), tuple(loaded.tokenizer.encode(text, add_special_tokens=False)))
             for text in ("Once upon a time", "The sea was calm", "Numbers: one two")]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None, max_prefill_tokens=4))
    passes, failed = [], []
    forward = engine.runner._forward  # every pass of a step goes through it

    def counted(entries, **kwargs):
        passes.append(len(entries))
        if fail_fused_once and not failed and len(entries) > 1 and any(e.seq.request is None for e in entries):
            failed.append(True)
            raise RuntimeError("injected failure of a pass that carries an encoding chunk")
        return forward(entries, **kwargs)

    engine.runner._forward = counted
    schema = runtime.parse_schema(SCHEMA)

    async def main():
        decoding = [asyncio.create_task(_tokens(engine, plan, params)) for plan in plans]
        await asyncio.sleep(0.05)
        passes.clear()
        steps = engine.num_steps
        await asyncio.wrap_future(engine.encode_schema(schema))
        return await asyncio.gather(*decoding), list(passes), engine.num_steps - steps

    try:
        tokens, seen, steps = asyncio.run(main())
    finally:
        engine.stop()
    difference = 0.0
    for segment_id, context_ids in runtime.module_encoder.schema_jobs(schema):
        key = runtime.module_encoder.key(schema, segment_id, context_ids, None)
        ours, theirs = runtime.module_encoder.store.get(key)[0], reference.module_encoder.store.get(key)[0]
        difference = max(difference, (ours.keys - theirs.keys).abs().max().item())
    oracle = [reference_tokens(loaded, plan, params) for plan in plans]
    return tokens, oracle, difference, seen, steps, bool(failed)


def test_an_encoding_chunk_shares_the_decode_pass():
    tokens, oracle, difference, passes, steps, _ = _encode_while_decoding(fail_fused_once=False)
    assert tokens == oracle and difference <= 1e-5
    # One forward pass per step, carrying the decoding sequences and the encoding chunk together
    # (counted from another thread: a step may fall between the two reads).
    assert steps > 3 and abs(len(passes) - steps) <= 1 and max(passes) == 4


def test_a_failed_shared_pass_reruns_the_encoding_and_the_sequences_alone():
    tokens, oracle, difference, passes, _, failed = _encode_while_decoding(fail_fused_once=True)
    assert failed and tokens == oracle and difference <= 1e-5
    # Decode-only passes of the 3 sequences may run before the upload reaches the engine; from the failed
    # pass (3 sequences + the encoding chunk) on: the encoding chunk, then each sequence alone.
    first = passes.index(4)
    assert set(passes[:first]) <= {3} and passes[first: first + 5] == [4, 1, 1, 1, 1], passes[:8]


def test_prompt_logprobs_across_chunks_equal_one_full_forward():
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema('<schema name="plain"/>'), encode=False)
    ids = tuple(runtime.loaded.tokenizer.encode(TEXT[:200], add_special_tokens=False))
    plan = token_plan(runtime.get_schema("plain"), ids)
    with torch.no_grad():
        expected = torch.log_softmax(runtime.loaded.model(torch.tensor([ids])).logits[0].float(), dim=-1)
    engine = Engine(runtime.module_encoder, EngineConfig(max_prefill_tokens=4, max_prefill_tokens_alone=8))
    params = SamplingParams(max_tokens=2, temperature=0, n=2, prompt_logprobs=3)

    async def run():
        async for event in engine.submit(plan, params):
            assert event.report is None or event.report.error is None, event.report
            if event.report is not None:
                return event.report.prompt_logprobs

    try:
        asyncio.run(_tokens(engine, plan))  # the prompt's prefix is now stored: it must not be reused
        found = asyncio.run(run())
    finally:
        engine.stop()
    assert len(ids) > 3 * 8 and len(found) == len(ids) - 1
    assert [f.logprob for f in found] == pytest.approx([float(expected[i, ids[i + 1]]) for i in range(len(ids) - 1)],
                                                       abs=1e-4)
    assert [f.top[0][0] for f in found] == [int(expected[i].argmax()) for i in range(len(ids) - 1)]


def test_an_upload_for_others_is_kept_here_only_where_a_request_here_needs_it(tmp_path):
    """encode_schema(keep_local=False) writes the shared tier only, except the KV a request on this engine
    asked for while the upload was encoding: that job is kept locally too (the request reads no disk)."""
    loaded = _tiny_loaded("llama", torch.float32)
    runtime = ModelRuntime(loaded, build_store(StoreConfig(disk_dir=str(tmp_path))))
    schema = runtime.parse_schema(SCHEMA)
    runtime.add_schema(schema, encode=False)
    plan = runtime.plan(PROMPTS[2])  # imports d3 only
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None, max_prefill_tokens=2,
                                                         max_prefill_tokens_alone=2))
    run = engine.runner.run

    def paced(plan):  # d0..d2 take dozens of 2-token steps: even a descheduled test thread submits before d3
        time.sleep(0.005)
        return run(plan)

    engine.runner.run = paced

    async def main():
        upload = engine.encode_schema(schema, keep_local=False)  # 2 tokens a step: d3 is still queued below
        tokens, final = [], None
        async for event in engine.submit(plan, GREEDY, fidelity=Fidelity("fast")):
            assert event.report is None or event.report.error is None, event.report
            tokens += [event.token_id] if event.token_id is not None else []
            final = event
        return tokens, final.report.cache.modules, await asyncio.wrap_future(upload)

    try:
        tokens, modules, report = asyncio.run(main())
    finally:
        engine.stop()
    store, encoder = runtime.module_encoder.store, runtime.module_encoder
    assert store.flush(10) and report.num_encoded > 0
    assert tokens == reference_tokens(loaded, plan, GREEDY, Fidelity("fast"))  # fast, layout positions
    assert [(m.path, m.tier) for m in modules] == [("d3", "computed")]  # it waited for d3's encoding
    used = {encoder.key(schema, c.segment.segment_id, c.context_ids, None) for c in plan.cached}
    for segment_id, context_ids in encoder.schema_jobs(schema):
        key = encoder.key(schema, segment_id, context_ids, None)
        assert store.tier_of(key).name == ("device" if key in used else "disk"), schema.segments[segment_id].owner

"""The engine against the HF reference: same greedy tokens under continuous batching and one at a time."""

from __future__ import annotations

import asyncio
import random

import pytest

from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.engine import Engine, EngineConfig
from tests.conftest import make_tiny_runtime
from tests.model_runtime.oracles import reference_tokens

SCHEMA = """<schema name="lib"><system>Answer from the documents.</system>
  <user>
    <module name="d0">Zero: cats sleep most of the day.</module>
    <module name="d1">One: tea is brewed with hot water in a pot.</module>
    <module name="d2">Two: Rome was not built in a day.</module>
    <module name="d3">Three: the moon orbits the earth every month.</module>
    <module name="d4">Four: bees make honey from nectar.</module>
  </user>
</schema>"""


async def _collect(stream) -> dict[int, list]:
    tokens: dict[int, list] = {}
    final = None
    async for event in stream:
        if event.token_id is not None:
            tokens.setdefault(event.index, []).append(event.token_id)
        if event.report is not None:
            final = event
    return {"tokens": tokens, "final": final}


def _prompts(rng: random.Random, count: int) -> list[str]:
    prompts = []
    for i in range(count):
        docs = rng.sample([f"d{k}" for k in range(5)], rng.randint(1, 4))
        prompts.append(f'<prompt schema="lib"><user>{"".join(f"<{d}/>" for d in docs)}Question {i}?</user>'
                       '<assistant/></prompt>')
    return prompts


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("max_num_seqs", [6, 1], ids=["batched", "one-at-a-time"])
def test_engine_matches_the_hf_reference(arch, max_num_seqs):
    runtime = make_tiny_runtime(arch)
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    rng = random.Random(1)
    prompts = _prompts(rng, 10)
    params = [SamplingParams(max_tokens=rng.randint(3, 12), temperature=0, ignore_eos=True, n=3 if i % 3 == 0 else 1)
              for i in range(len(prompts))]
    expected = [reference_tokens(runtime.loaded, runtime.plan(p), sp) for p, sp in zip(prompts, params)]
    engine = Engine(runtime.module_encoder, EngineConfig(max_num_seqs=max_num_seqs))

    async def main():
        tasks = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            tasks.append(asyncio.create_task(_collect(engine.submit(runtime.plan(prompt), sp))))
            if i % 4 == 3:
                await asyncio.sleep(0.01)  # later requests join a batch already running
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    for result, want, sp in zip(results, expected, params):
        assert result["final"] is not None and result["final"].report.error is None
        assert sorted(result["tokens"]) == list(range(sp.n))
        for tokens in result["tokens"].values():
            assert tokens == want
    assert engine.num_steps > 0 and engine.scheduler.memory.used_bytes == 0


def test_abort_frees_memory_and_budget_holds():
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    config = EngineConfig(max_num_seqs=8, max_kv_bytes=400_000)
    engine = Engine(runtime.module_encoder, config)
    peak = {"bytes": 0}
    original = engine.outputs.postprocess

    def watched(plan, output):
        peak["bytes"] = max(peak["bytes"], engine.scheduler.memory.used_bytes)
        assert engine.scheduler.memory.used_bytes <= config.max_kv_bytes
        return original(plan, output)

    engine.outputs.postprocess = watched
    prompts = _prompts(random.Random(2), 6)

    async def main():
        long = engine.submit(runtime.plan(prompts[0]), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
                             request_id="long")
        others = [asyncio.create_task(_collect(engine.submit(runtime.plan(p), SamplingParams(max_tokens=5))))
                  for p in prompts[1:]]
        seen = 0
        async for event in long:
            seen += 1
            if seen == 3:
                before = engine.scheduler.memory.used_bytes
                engine.abort("long")
            if event.finish_reason == "abort":
                break
        results = await asyncio.gather(*others)
        return before, event, results

    try:
        before, last, results = asyncio.run(main())
    finally:
        engine.stop()
    assert last.finish_reason == "abort" and before > 0
    assert all(r["final"].report.error is None for r in results)
    assert engine.scheduler.memory.used_bytes == 0 and peak["bytes"] > 0


def test_request_larger_than_budget_is_refused():
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    engine = Engine(runtime.module_encoder, EngineConfig(max_kv_bytes=10_000))

    async def main():
        return await _collect(engine.submit(runtime.plan(_prompts(random.Random(3), 1)[0]), SamplingParams()))

    try:
        result = asyncio.run(main())
    finally:
        engine.stop()
    assert result["final"].report.error and "budget" in result["final"].report.error

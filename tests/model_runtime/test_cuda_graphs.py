"""Graph-captured steps on a real CUDA device with Triton (skipped without; scripts/gpu_check.sh runs them): a replayed
step equals the same static step run eagerly, capture and replay issue no host sync (`set_sync_debug_mode("error")`),
and an engine of a bf16 tiny model answers greedy requests with the same tokens with graphs on and off."""

from __future__ import annotations

import asyncio
import importlib.util
import random

import pytest
import torch

from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, SamplingParams
from promptcache.model_runtime.engine import Engine, EngineConfig
from promptcache.model_runtime.engine.cuda_graphs import GraphedSteps
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.engine.step_plan import ScheduledSeq
from tests.model_runtime.test_engine import SCHEMA, _prompts
from tests.model_runtime.test_static_step import _loaded, _sequences, _twins

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None, reason="needs CUDA and Triton")]


def _bf16():
    return _loaded("cuda", torch.bfloat16)


@pytest.mark.parametrize(("num_seqs", "num_new"), [(3, 1), (5, 1), (1, 7)], ids=["decode3", "decode5", "prefill7"])
def test_replay_equals_eager_and_syncs_nothing(num_seqs, num_new):
    loaded = _bf16()
    seqs = _sequences(loaded, num_seqs, num_new=num_new, prefill=num_new > 1)
    twins = _twins(seqs)
    eager = GraphedSteps(loaded.model, backend="auto", max_num_seqs=8, use_graphs=False)
    graphed = GraphedSteps(loaded.model, backend="auto", max_num_seqs=8, use_graphs=True)
    assert graphed.use_kernel, "bf16 on CUDA with Triton attends through the kernel"
    segments = [lambda entries: []]  # own KV only, then a shared block
    with torch.inference_mode():
        runner = ModelRunner(loaded, cuda_graphs=False)
        segments.append(runner._segments)
        for segments_of in segments:
            expected = eager.run([ScheduledSeq(s, num_new) for s in twins], segments_of)
            graphed.run([ScheduledSeq(s, num_new) for s in seqs], segments_of)  # warm-up (eager)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = graphed.run([ScheduledSeq(s, num_new) for s in seqs], segments_of)  # capture, replay
                again = graphed.run([ScheduledSeq(s, num_new) for s in seqs], segments_of)  # replay
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert expected is not None and got is not None and again is not None
            torch.testing.assert_close(got.logits[:num_seqs], expected.logits[:num_seqs], rtol=2e-2, atol=2e-2)
            assert torch.equal(again.logits, got.logits)
            pool, twin_pool = seqs[0].own_pool, twins[0].own_pool
            assert pool is not None and twin_pool is not None
            for s in seqs:  # the real rows' KV as the eager step wrote it
                written = slice(s.own_slot + s.own_length, s.own_slot + s.own_length + num_new)  # type: ignore
                torch.testing.assert_close(pool.keys[:, :, written], twin_pool.keys[:, :, written],
                                           rtol=2e-2, atol=2e-2)
    assert len(graphed.graphs) == 2  # one per shape (no segment, one segment)


def test_engine_answers_the_same_with_graphs_on_and_off():
    """Greedy answers of a bf16 engine, requests alone and batched: graphs replay its decode steps and lone
    prefills; bf16 rounding may part them after a near-tie, so the first tokens must agree and most of the rest."""
    runtime = ModelRuntime(_bf16(), build_store(StoreConfig(), device="cuda"))  # fused, as a GPU loads it
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    prompts = _prompts(random.Random(4), 6)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def answers(cuda_graphs: bool) -> tuple[list[list[int]], int]:
        engine = Engine(runtime.module_encoder, EngineConfig(prefix=None, cuda_graphs=cuda_graphs))

        async def main() -> list[list[int]]:
            async def one(prompt) -> list[int]:
                tokens = []
                async for event in engine.submit(runtime.plan(prompt), params):
                    tokens += [event.token_id] if event.token_id is not None else []
                return tokens
            return list(await asyncio.gather(*(one(p) for p in prompts)))

        try:
            found = asyncio.run(main())
            return found, 0 if engine.runner.graphs is None else len(engine.runner.graphs.graphs)
        finally:
            engine.stop()

    off, no_graphs = answers(False)
    on, num_graphs = answers(True)
    assert no_graphs == 0 and num_graphs > 0
    assert [a[0] for a in on] == [a[0] for a in off]
    same = sum(x == y for a, b in zip(on, off) for x, y in zip(a, b))
    assert same >= 0.75 * sum(len(a) for a in off), (on, off)

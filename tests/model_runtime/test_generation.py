"""Generation controls in the engine: sampling, seeds, stop strings, max_tokens, EOS, the model's last
position, usage and timings; greedy tokens against the HF reference."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import torch

from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.engine import Engine, EngineConfig, TokenEvent
from promptcache.model_runtime.sampling import Sampler
from promptcache.pml import token_plan
from tests.model_runtime.oracles import reference_greedy

SCHEMA = '<schema name="g">A short preface.<module name="m">Some module text for generation.</module></schema>'
PROMPT = '<prompt schema="g"><m/>Continue:</prompt>'


@dataclass
class Served:
    """What one request streamed, per sample index."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    final: TokenEvent | None = None


class Harness:
    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.engine = Engine(runtime.module_encoder, EngineConfig(prefix=None))

    def serve(self, plan, params: SamplingParams) -> Served:
        async def main() -> Served:
            served = Served()
            async for event in self.engine.submit(plan, params):
                assert event.report is None or event.report.error is None, event.report
                if event.token_id is not None:
                    served.tokens.setdefault(event.index, []).append(event.token_id)
                served.text[event.index] = served.text.get(event.index, "") + event.text
                if event.finish_reason is not None:
                    served.finish[event.index] = event.finish_reason
                if event.report is not None:
                    served.final = event
            return served

        return asyncio.run(main())


@pytest.fixture
def harness(tiny_runtime, engines):
    runtime = tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    runtime.add_schema(runtime.parse_schema('<schema name="plain"/>'), encode=False)
    return engines(Harness, runtime=runtime)


def test_greedy_is_deterministic_and_counts_usage(harness):
    plan = harness.runtime.plan(PROMPT)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    a, b = harness.serve(plan, params), harness.serve(plan, params)
    assert a.tokens == b.tokens == {0: reference_greedy(harness.runtime.loaded, plan, params)[0]}
    assert len(a.tokens[0]) == 8 and a.finish == {0: "length"}
    usage = a.final.report.usage
    assert usage.prompt_tokens == plan.num_prompt_tokens and usage.cached_tokens == plan.num_cached_tokens
    assert usage.completion_tokens == 8 and usage.total_tokens == plan.num_prompt_tokens + 8
    t = a.final.report.timings
    assert 0 < t.prefill_ms <= t.ttft_ms <= t.total_ms and t.assembly_ms >= 0


def test_seeded_sampling_reproduces_and_n_samples_differ(harness):
    plan = harness.runtime.plan(PROMPT)
    params = SamplingParams(max_tokens=12, temperature=1.5, seed=3, n=3, ignore_eos=True)
    first, second = harness.serve(plan, params), harness.serve(plan, params)
    assert first.tokens == second.tokens and sorted(first.tokens) == [0, 1, 2]
    assert len({tuple(tokens) for tokens in first.tokens.values()}) > 1
    assert first.final.report.usage.completion_tokens == 36


def test_sampler_filters():
    logits = torch.tensor([0.0, 5.0, 4.9, -1.0])
    assert all(Sampler(SamplingParams(temperature=1.0, top_k=1, seed=s)).sample(logits) == 1 for s in range(20))
    picks = {Sampler(SamplingParams(temperature=1.0, top_k=2, seed=s)).sample(logits) for s in range(50)}
    assert picks == {1, 2}
    picks = {Sampler(SamplingParams(temperature=1.0, top_p=0.3, seed=s)).sample(logits) for s in range(50)}
    assert picks == {1}
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


def test_eos_stops_generation(harness):
    runtime = harness.runtime
    plan = runtime.plan(PROMPT)
    free = harness.serve(plan, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)).tokens[0]
    eos_id = free[2]
    object.__setattr__(runtime.loaded, "eos_token_ids", (eos_id,))
    try:
        params = SamplingParams(max_tokens=5, temperature=0)
        stopped = harness.serve(plan, params)
        want = reference_greedy(runtime.loaded, plan, params)
    finally:
        object.__setattr__(runtime.loaded, "eos_token_ids", ())
    assert stopped.tokens[0] == free[: free.index(eos_id) + 1] == want[0]
    assert stopped.finish == {0: "stop"} and want[1] == "stop"


def test_stop_string_truncates(harness):
    plan = harness.runtime.plan(PROMPT)
    free = harness.serve(plan, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)).text[0]
    assert len(free) > 4
    stop = free[2:4]
    result = harness.serve(plan, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,)))
    assert result.finish == {0: "stop"} and result.text[0] == free[: free.find(stop)]


def test_generation_ends_with_length_at_the_models_last_position(harness):
    """A prompt 3 positions short of the model's limit: the 4th token would be fed past it, so the engine
    stops there with "length", as the reference does, whatever max_tokens asks for."""
    loaded = harness.runtime.loaded
    ids = tuple([7, 8, 9] * loaded.max_positions)[:loaded.max_positions - 3]
    plan = token_plan(harness.runtime.get_schema("plain"), ids)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    served = harness.serve(plan, params)
    assert (served.tokens[0], served.finish[0]) == reference_greedy(loaded, plan, params)
    assert len(served.tokens[0]) == 4 and served.finish == {0: "length"}

"""Generation controls: sampling, seeds, stop strings, max_tokens, EOS, usage and timings."""

from __future__ import annotations

import pytest
import torch

from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.detokenizer import Detokenizer
from promptcache.model_runtime.sampling import Sampler
from tests.model_factories import make_test_tokenizer

SCHEMA = '<schema name="g">A short preface.<module name="m">Some module text for generation.</module></schema>'
PROMPT = '<prompt schema="g"><m/>Continue:</prompt>'


@pytest.fixture
def runtime(tiny_runtime):
    rt = tiny_runtime("llama")
    rt.add_schema(rt.parse_schema(SCHEMA))
    return rt


def test_greedy_is_deterministic_and_counts_usage(runtime):
    plan = runtime.plan(PROMPT)
    a = runtime.generate(plan, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    b = runtime.generate(plan, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8 and a.finish_reason == "length"
    assert a.usage.prompt_tokens == plan.num_prompt_tokens
    assert a.usage.cached_tokens == plan.num_cached_tokens
    assert a.usage.completion_tokens == 8 and a.usage.total_tokens == plan.num_prompt_tokens + 8
    t = a.timings
    assert 0 < t.prefill_ms <= t.ttft_ms <= t.total_ms and t.assembly_ms >= 0


def test_seeded_sampling_reproduces_and_n_samples_differ(runtime):
    plan = runtime.plan(PROMPT)
    params = SamplingParams(max_tokens=12, temperature=1.5, seed=3, n=3, ignore_eos=True)
    first, second = runtime.generate(plan, params), runtime.generate(plan, params)
    assert [c.token_ids for c in first.completions] == [c.token_ids for c in second.completions]
    assert len({c.token_ids for c in first.completions}) > 1
    assert first.usage.completion_tokens == 36


def test_sampler_filters():
    logits = torch.tensor([0.0, 5.0, 4.9, -1.0])
    assert all(Sampler(SamplingParams(temperature=1.0, top_k=1, seed=s)).sample(logits) == 1 for s in range(20))
    picks = {Sampler(SamplingParams(temperature=1.0, top_k=2, seed=s)).sample(logits) for s in range(50)}
    assert picks == {1, 2}
    picks = {Sampler(SamplingParams(temperature=1.0, top_p=0.3, seed=s)).sample(logits) for s in range(50)}
    assert picks == {1}
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


def test_eos_stops_generation(runtime):
    plan = runtime.plan(PROMPT)
    free = runtime.generate(plan, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    eos_id = free.token_ids[2]
    object.__setattr__(runtime.loaded, "eos_token_ids", (eos_id,))
    try:
        stopped = runtime.generate(plan, SamplingParams(max_tokens=5, temperature=0))
    finally:
        object.__setattr__(runtime.loaded, "eos_token_ids", ())
    first = free.token_ids.index(eos_id)
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"


def test_stop_string_truncates(runtime):
    plan = runtime.plan(PROMPT)
    free = runtime.generate(plan, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert len(free.text) > 4
    stop = free.text[2:4]
    result = runtime.generate(plan, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,)))
    assert result.finish_reason == "stop" and result.text == free.text[: free.text.find(stop)]


def test_detokenizer_holds_back_partial_stop_strings():
    tokenizer = make_test_tokenizer()
    ids = tokenizer.encode("the sky is blue and the dog runs", add_special_tokens=False)
    detok = Detokenizer(tokenizer, stop=("dog",))
    deltas = [detok.push(t) for t in ids]
    streamed = "".join(deltas) + detok.flush()
    assert detok.is_stopped and streamed == "the sky is blue and the "
    assert "d" not in "".join(deltas[:-1]).split("and the")[-1]  # "d..." was never streamed early

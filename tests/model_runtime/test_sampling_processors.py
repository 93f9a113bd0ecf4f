"""Sampling on the engine path against Hugging Face's own generation code (the oracle): logits
processors and warpers on random scores, and generation through the batched engine vs `model.generate`
with the same settings (greedy), or vs the model's full-prefill distribution (seeded min_p)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.baseline import full_prefill_logits
from promptcache.model_runtime.engine import Engine, EngineConfig, Fidelity, resolve
from promptcache.model_runtime.engine.outputs import OutputProcessor
from promptcache.model_runtime.engine.prefix import PrefixReuse
from promptcache.model_runtime.engine.request import Request
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.engine.scheduler import Scheduler
from promptcache.model_runtime.sampling import PromptTokens, Sampler
from promptcache.pml import token_plan
from tests.conftest import make_tiny_runtime

VOCAB = 300


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence/frequency penalties over the generated tokens (after `prompt_len`), written
    from its documentation: logit[j] -= frequency * count[j] + presence * (count[j] > 0)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class RepetitionAfter(LogitsProcessor):
    """HF's repetition penalty restricted to the ids after `start`: what a sampler that missed the
    reused part of the prompt would apply (used to show the module test can tell the difference)."""

    def __init__(self, start: int, penalty: float) -> None:
        self.start, self.penalty = start, penalty

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        ids = input_ids[:, self.start:]
        picked = torch.gather(scores, 1, ids)
        picked = torch.where(picked < 0, picked * self.penalty, picked / self.penalty)
        return scores.scatter(1, ids, picked)


def hf_processors(params: SamplingParams, prompt_len: int) -> LogitsProcessorList:
    """HF's processors and warpers for `params`, in the order `_get_logits_processor` (transformers 5)
    builds them: sequence bias, repetition penalty, (OpenAI's penalties), then when sampling
    temperature, top-k, top-p, min-p."""
    chain: list = []
    if params.logit_bias:
        chain.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias}))
    if params.repetition_penalty != 1:
        chain.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        chain.append(OpenAIPenalties(prompt_len, params.presence_penalty, params.frequency_penalty))
    if params.temperature > 0:
        chain.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            chain.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1:
            chain.append(TopPLogitsWarper(params.top_p))
        if params.min_p:
            chain.append(MinPLogitsWarper(params.min_p))
    return LogitsProcessorList(chain)


PARAMS = [
    SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.3, min_p=0.2),
    SamplingParams(temperature=0.9, repetition_penalty=1.3, logit_bias=((3, 5.0), (7, -100.0), (11, 2.5))),
    SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.5, top_p=0.8),
    SamplingParams(temperature=0, repetition_penalty=0.7, presence_penalty=-1.0, frequency_penalty=1.5,
                   logit_bias=((5, 1.0),)),
    SamplingParams(temperature=0.8, top_k=1, repetition_penalty=2.0),  # greedy by top_k: warpers still apply
]


def _random_params(rng: random.Random) -> SamplingParams:
    """Any combination of the fields, each on or off."""
    pick = rng.random
    bias = tuple((t, rng.uniform(-100, 100)) for t in rng.sample(range(VOCAB), rng.randint(1, 6)))
    return SamplingParams(
        temperature=0 if pick() < 0.2 else rng.uniform(0.2, 2.0),
        top_k=rng.choice([0, 0, 1, 5, 40, 1000]),
        top_p=1.0 if pick() < 0.4 else rng.uniform(0.05, 1.0),
        min_p=0.0 if pick() < 0.4 else rng.uniform(0.0, 1.0),
        repetition_penalty=1.0 if pick() < 0.3 else rng.uniform(0.1, 4.0),
        presence_penalty=0.0 if pick() < 0.4 else rng.uniform(-2, 2),
        frequency_penalty=0.0 if pick() < 0.4 else rng.uniform(-2, 2),
        logit_bias=() if pick() < 0.4 else bias)


def _assert_equals_hf(params: SamplingParams, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (20,), generator=g).tolist()
    generated = [*torch.randint(0, VOCAB, (9,), generator=g).tolist(), 3, 3, prompt[0]]
    sampler = Sampler(params, prompt=PromptTokens(prompt))
    for token in generated:  # the history as sampling would have built it
        sampler.record(token)
    logits = torch.randn(VOCAB, generator=g) * 3
    ours = sampler.scores(logits)
    input_ids = torch.tensor([prompt + generated])
    theirs = hf_processors(params, len(prompt))(input_ids, logits.clone().unsqueeze(0))[0]
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), params  # the same tokens are excluded
    assert torch.allclose(torch.softmax(ours, -1), torch.softmax(theirs, -1), atol=1e-6), params
    if params.temperature == 0:  # greedy: the argmax of the processed scores, not of the raw logits
        assert sampler.sample(logits) == int(torch.argmax(theirs))


@pytest.mark.parametrize("index", range(len(PARAMS)))
def test_processed_distribution_equals_hf(index):
    _assert_equals_hf(PARAMS[index], index)


def test_random_combinations_equal_hf():
    rng = random.Random(0)
    for seed in range(40):
        _assert_equals_hf(_random_params(rng), 100 + seed)


def test_presence_and_frequency_follow_openai_formula_over_generated_tokens_only():
    g = torch.Generator().manual_seed(1)
    prompt, logits = [4, 4, 9, 250], torch.randn(VOCAB, generator=g)
    generated = [9, 9, 9, 17, 250, 17]
    sampler = Sampler(SamplingParams(temperature=0, presence_penalty=0.6, frequency_penalty=-0.3),
                      prompt=PromptTokens(prompt))
    for token in generated:
        sampler.record(token)
    expected = logits.clone()
    for token in set(generated):  # OpenAI's docs: mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence
        expected[token] -= generated.count(token) * -0.3 + 0.6
    assert torch.allclose(sampler.scores(logits), expected, atol=1e-6)


def test_min_p_sampling_is_reproducible_and_stays_in_the_allowed_set():
    params = SamplingParams(temperature=1.0, min_p=0.3, seed=7)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    probs = torch.softmax(logits, -1)
    allowed = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    assert len(allowed) > 1
    assert len({Sampler(params).sample(logits) for _ in range(3)}) == 1  # same seed, same draw
    many = Sampler(SamplingParams(temperature=1.0, min_p=0.3, seed=1))
    draws = {many.sample(logits) for _ in range(200)}
    assert draws <= allowed and len(draws) > 1


@pytest.mark.parametrize(("bad", "field"), [
    (dict(min_p=2), "min_p"), (dict(min_p=-0.1), "min_p"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(logit_bias=((1, 500.0),)), "logit_bias"), (dict(logit_bias=((-1, 1.0),)), "logit_bias"),
])
def test_out_of_range_values_are_refused_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


# -- through the engine ---------------------------------------------------------------------------

TEXT = "The quick brown fox jumps over the lazy dog. The dog sleeps. The fox runs and the fox jumps again."
SCHEMA = """<schema name="lib"><system>Answer from the documents only.</system>
  <user>
    <module name="d0">Zero: cats sleep most of the day and dream of fish. Cats sleep, cats dream.</module>
    <module name="d1">One: tea is brewed with hot water in a pot.</module>
  </user>
</schema>"""
MODULE_PROMPT = '<prompt schema="lib"><user><d0/><d1/>What do cats do?</user><assistant/></prompt>'
GREEDY = dict(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def runtime():
    rt = make_tiny_runtime("llama")
    rt.add_schema(rt.parse_schema('<schema name="plain"/>'), encode=False)
    rt.add_schema(rt.parse_schema(SCHEMA))
    return rt


def _engine_outputs(runtime, runs: list[tuple], fidelity: Fidelity | None = None) -> list[dict[int, list[int]]]:
    """Every (plan, params) of `runs` submitted at once to one engine: they share its steps."""
    engine = Engine(runtime.module_encoder, EngineConfig(max_num_seqs=16))

    async def collect(plan, params):
        tokens: dict[int, list[int]] = {}
        async for event in engine.submit(plan, params, fidelity=fidelity):
            assert event.report is None or event.report.error is None, event.report
            if event.token_id is not None:
                tokens.setdefault(event.index, []).append(event.token_id)
        return tokens

    async def main():
        return await asyncio.gather(*(collect(plan, params) for plan, params in runs))

    try:
        return asyncio.run(main())
    finally:
        engine.stop()


@torch.inference_mode()
def _hf_greedy(model, ids, **hf_kwargs) -> list[int]:
    out = model.generate(torch.tensor([list(ids)]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0, **hf_kwargs)
    return out[0, len(ids):].tolist()


def test_greedy_penalties_and_bias_in_one_batch_equal_hf_generate(runtime):
    model, plain = runtime.loaded.model, runtime.get_schema("plain")
    ids = tuple(runtime.loaded.tokenizer.encode(TEXT, add_special_tokens=False))
    cases = [
        (SamplingParams(**GREEDY), {}),
        (SamplingParams(**GREEDY, repetition_penalty=1.8), dict(repetition_penalty=1.8)),
        (SamplingParams(**GREEDY, repetition_penalty=0.6, n=2), dict(repetition_penalty=0.6)),
        (SamplingParams(**GREEDY, logit_bias=((ids[3], 4.0), (ids[5], -50.0))),
         dict(sequence_bias={(ids[3],): 4.0, (ids[5],): -50.0})),
        (SamplingParams(**GREEDY, presence_penalty=1.5, frequency_penalty=0.9, n=2),
         dict(logits_processor=LogitsProcessorList([OpenAIPenalties(len(ids), 1.5, 0.9)]))),
        (SamplingParams(**GREEDY, logit_bias=((ids[1], 3.0),), repetition_penalty=1.4, presence_penalty=-0.5,
                        frequency_penalty=0.7),
         dict(sequence_bias={(ids[1],): 3.0}, repetition_penalty=1.4,
              logits_processor=LogitsProcessorList([OpenAIPenalties(len(ids), -0.5, 0.7)]))),
    ]
    outputs = _engine_outputs(runtime, [(token_plan(plain, ids), params) for params, _ in cases])
    wants = [_hf_greedy(model, ids, **hf_kwargs) for _, hf_kwargs in cases]
    for (params, _), got, want in zip(cases, outputs, wants):
        assert sorted(got) == list(range(params.n))
        assert all(tokens == want for tokens in got.values()), (params, got, want)
    assert all(want != wants[0] for want in wants[1:])  # every setting changed what greedy picks


def test_repetition_penalty_covers_reused_module_tokens(runtime):
    plan = runtime.plan(MODULE_PROMPT)
    reuse = resolve(plan, Fidelity("exact"))  # exact: reused KV equals a full prefill's, so HF is the oracle
    ids, num_reused = plan.token_ids(), len(plan.token_ids()) - len(reuse.token_ids)
    assert reuse.uses and num_reused > 0
    want = _hf_greedy(runtime.loaded.model, ids, repetition_penalty=3.0)
    # A sampler that saw only the computed tokens would pick differently here:
    assert _hf_greedy(runtime.loaded.model, ids, logits_processor=LogitsProcessorList(
        [RepetitionAfter(num_reused, 3.0)])) != want
    params = SamplingParams(**GREEDY, repetition_penalty=3.0, n=2)
    [got] = _engine_outputs(runtime, [(plan, params)], Fidelity("exact"))
    assert got == {0: want, 1: want}


def test_the_n_samples_share_one_prompt_mask(runtime):
    plan = runtime.plan(MODULE_PROMPT)
    prefix = PrefixReuse(None)
    scheduler = Scheduler(EngineConfig(prefix=None), runtime.module_encoder, prefix)
    request = Request("r", plan, SamplingParams(max_tokens=2, repetition_penalty=1.5, n=3, seed=0), None)
    scheduler.add(request)
    step = scheduler.schedule()
    assert not step.events
    OutputProcessor(scheduler, prefix).postprocess(step, ModelRunner(runtime.loaded).run(step))  # prefill, fork
    assert len(request.sequences) == 3
    assert all(seq.sampler.prompt is request.prompt_tokens for seq in request.sequences)
    vocab = runtime.loaded.model.config.vocab_size
    mask = request.prompt_tokens.mask(vocab, torch.device("cpu"))
    assert set(torch.nonzero(mask).flatten().tolist()) == set(plan.token_ids())  # reused ids included


def test_seeded_min_p_through_the_engine_is_reproducible_and_stays_in_the_allowed_set(runtime):
    model, plain = runtime.loaded.model, runtime.get_schema("plain")
    ids = list(runtime.loaded.tokenizer.encode(TEXT, add_special_tokens=False))
    min_p = 0.5
    params = SamplingParams(max_tokens=10, temperature=1.0, min_p=min_p, seed=11, n=2, ignore_eos=True)
    plan = token_plan(plain, tuple(ids))
    first, second = _engine_outputs(runtime, [(plan, params), (plan, params)])
    assert first == second and sorted(first) == [0, 1]  # same seed, same draws (batched together)
    num_choices = 0
    for tokens in first.values():
        logits = full_prefill_logits(model, ids + tokens[:-1])[len(ids) - 1:]  # [len(tokens), vocab]
        probs = torch.softmax(logits, dim=-1)
        for step, token in enumerate(tokens):
            threshold = min_p * probs[step].max()
            assert probs[step, token] >= threshold * (1 - 1e-4), (step, token)  # never a min_p-cut token
            num_choices += int((probs[step] >= threshold).sum() > 1)
    assert num_choices > 0  # min_p left a choice somewhere: sampling was exercised, not just argmax
    assert first[0] != first[1]

def test_plain_greedy_params_take_the_batch_argmax_that_sample_would_pick():
    """The engine takes a plain greedy row's token from one argmax over the batch's logits: it must be
    what `sample` picks, and params that change the scores must not be plain."""
    torch.manual_seed(0)
    logits = torch.randn(4, 300)
    for row, best in zip(logits, logits.argmax(dim=-1).tolist()):
        assert Sampler(SamplingParams(temperature=0)).take(best) == Sampler(SamplingParams(temperature=0)).sample(row)
    assert SamplingParams(temperature=0).is_plain_greedy
    assert not SamplingParams(temperature=0, logit_bias=((3, 5.0),)).is_plain_greedy
    assert not SamplingParams(temperature=0, repetition_penalty=1.3).is_plain_greedy
    assert not SamplingParams(temperature=0.7).is_plain_greedy

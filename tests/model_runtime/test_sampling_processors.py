"""Sampling on the engine path against Hugging Face's own generation code (the oracle): logits
processors and warpers on random scores, and greedy generation through the batched engine vs
`model.generate` with the same settings."""

from __future__ import annotations

import asyncio

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
from promptcache.model_runtime.engine import Engine, EngineConfig
from promptcache.model_runtime.sampling import Sampler
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


def hf_processors(params: SamplingParams, prompt_len: int) -> LogitsProcessorList:
    """HF's processors and warpers for `params`, in the order `generate` builds them."""
    chain: list = []
    if params.logit_bias:
        chain.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias}))
    if params.repetition_penalty != 1:
        chain.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        chain.append(OpenAIPenalties(prompt_len, params.presence_penalty, params.frequency_penalty))
    if not params.is_greedy:
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
]


@pytest.mark.parametrize("index", range(len(PARAMS)))
def test_processed_distribution_equals_hf(index):
    params = PARAMS[index]
    g = torch.Generator().manual_seed(index)
    prompt = torch.randint(0, VOCAB, (20,), generator=g).tolist()
    generated = [*torch.randint(0, VOCAB, (9,), generator=g).tolist(), 3, 3]
    sampler = Sampler(params, prompt_ids=prompt)
    for token in generated:  # the history as sampling would have built it
        sampler._history(torch.zeros(VOCAB))
        sampler._seen[token] = True
        sampler._counts[token] += 1
    logits = torch.randn(VOCAB, generator=g) * 3
    ours = sampler.scores(logits)
    input_ids = torch.tensor([prompt + generated])
    theirs = hf_processors(params, len(prompt))(input_ids, logits.clone().unsqueeze(0))[0]
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))  # the same tokens are excluded
    assert torch.allclose(torch.softmax(ours, -1), torch.softmax(theirs, -1), atol=1e-6)


def test_min_p_sampling_is_reproducible_and_stays_in_the_allowed_set():
    params = SamplingParams(temperature=1.0, min_p=0.3, seed=7)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    probs = torch.softmax(logits, -1)
    allowed = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    draws = [Sampler(params).sample(logits) for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same draw
    many = Sampler(SamplingParams(temperature=1.0, min_p=0.3, seed=1))
    assert {many.sample(logits) for _ in range(200)} <= allowed


def test_out_of_range_values_are_refused():
    for bad in (dict(min_p=2), dict(repetition_penalty=0), dict(presence_penalty=3),
                dict(logit_bias=((1, 500.0),)), dict(logit_bias=((-1, 1.0),))):
        with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
            SamplingParams(**bad)


TEXT = "The quick brown fox jumps over the lazy dog. The dog sleeps. The fox runs and the fox jumps again."


def _engine_outputs(runtime, plans_params):
    engine = Engine(runtime.module_encoder, EngineConfig(max_num_seqs=8))

    async def collect(plan, params):
        tokens: dict[int, list[int]] = {}
        async for event in engine.submit(plan, params):
            assert event.error is None, event.error
            if event.token_id is not None:
                tokens.setdefault(event.index, []).append(event.token_id)
        return tokens

    async def main():  # submitted together: they share engine steps (one batch)
        return await asyncio.gather(*(collect(plan, params) for plan, params in plans_params))

    try:
        return asyncio.run(main())
    finally:
        engine.stop()


def test_greedy_penalties_and_bias_in_one_batch_equal_hf_generate():
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema('<schema name="plain"/>'), encode=False)
    plain = runtime.get_schema("plain")
    model = runtime.loaded.model
    ids = tuple(runtime.loaded.tokenizer.encode(TEXT, add_special_tokens=False))
    base = dict(max_tokens=12, temperature=0, ignore_eos=True)
    cases = [
        (SamplingParams(**base), {}),
        (SamplingParams(**base, repetition_penalty=1.8), dict(repetition_penalty=1.8)),
        (SamplingParams(**base, logit_bias=((ids[3], 4.0), (ids[5], -50.0))),
         dict(sequence_bias={(ids[3],): 4.0, (ids[5],): -50.0})),
        (SamplingParams(**base, presence_penalty=1.5, frequency_penalty=0.9, n=2),
         dict(logits_processor=LogitsProcessorList([OpenAIPenalties(len(ids), 1.5, 0.9)]))),
    ]
    outputs = _engine_outputs(runtime, [(token_plan(plain, ids), params) for params, _ in cases])
    plain_out = None
    with torch.inference_mode():
        for (params, hf_kwargs), got in zip(cases, outputs):
            want = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0,
                                  **hf_kwargs)[0, len(ids):].tolist()
            assert all(tokens == want for tokens in got.values()), (params, got, want)
            plain_out = plain_out or want
    assert any(got[0] != plain_out for got in outputs[1:])  # the settings changed what greedy picks

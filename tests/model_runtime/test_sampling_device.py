"""Sampling state follows the logits' device: an exact repeat samples its first token from cached CPU
logits, the next tokens from logits on the model's device (here the meta device stands in for a GPU;
tests/model_runtime/test_cuda.py checks the values on a real one)."""

from __future__ import annotations

import pytest
import torch

from promptcache.model_runtime.sampling import PromptTokens, Sampler, SamplingParams

VOCAB = 50
PENALTIES = [dict(repetition_penalty=1.3), dict(presence_penalty=0.5), dict(frequency_penalty=0.7),
             dict(repetition_penalty=1.2, presence_penalty=-0.4, frequency_penalty=0.3, logit_bias=((3, 2.0),))]


@pytest.mark.parametrize("penalties", PENALTIES)
def test_cpu_logits_then_other_device_scores(penalties):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    prompt = PromptTokens([1, 2, 3, 7])
    sampler = Sampler(SamplingParams(temperature=0, **penalties), prompt=prompt)
    first = sampler.sample(logits)                   # cached CPU logits: state made on the CPU
    sampler.record(first)                            # recorded, not yet counted
    scores = sampler.scores(logits.to("meta"))       # the model's device: the state follows
    assert scores.device.type == "meta" and scores.shape == (VOCAB,)
    other = Sampler(SamplingParams(temperature=0, **penalties), prompt=prompt)  # n > 1: the shared mask
    assert other.scores(logits.to("meta")).device.type == "meta"

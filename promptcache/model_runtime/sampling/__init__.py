"""Sampling: parameters (`SamplingParams`), each sequence's state (`Sampler`), and a step's picks for all its rows
at once (`sample_batch`: [B, V] ops, one copy to the device and one back per step)."""

from promptcache.model_runtime.sampling.batch import Draw, batch_logprobs, batch_scores, sample_batch, token_logprobs
from promptcache.model_runtime.sampling.params import (
    MAX_LOGPROBS,
    MAX_SEED,
    MIN_TEMPERATURE,
    SamplingParams,
    TokenLogprobs,
)
from promptcache.model_runtime.sampling.state import PromptTokens, Sampler

__all__ = ["MAX_LOGPROBS", "MAX_SEED", "MIN_TEMPERATURE", "Draw", "PromptTokens", "Sampler", "SamplingParams",
           "TokenLogprobs", "batch_logprobs", "batch_scores", "sample_batch", "token_logprobs"]

"""Single-sequence generation from a prompt plan: cached prefill, then token-by-token decode.

This is the reference path (the batched engine must produce the same greedy tokens).
"""

from __future__ import annotations

import time

import torch

from promptcache.model_runtime.cached_prefill import PrefilledPrompt, prefill
from promptcache.model_runtime.detokenizer import Detokenizer
from promptcache.model_runtime.forward import logits_of, run_tokens
from promptcache.model_runtime.module_encoder import ModuleEncoder, check_positions
from promptcache.model_runtime.results import Completion, GenerationResult, Timings, Usage
from promptcache.model_runtime.sampling import PromptTokens, Sampler, SamplingParams
from promptcache.pml import PromptPlan


def generate(encoder: ModuleEncoder, plan: PromptPlan, params: SamplingParams,
             cache_salt: str | None = None) -> GenerationResult:
    """Generate `params.n` completions for `plan`; the samples share one prefill."""
    started = time.perf_counter()
    prompt = prefill(encoder, plan, cache_salt=cache_salt, extra_capacity=params.max_tokens)
    completions = []
    ttft_ms = 0.0
    prompt_tokens = PromptTokens(plan.token_ids()) if params.uses_prompt_tokens else None
    for index in range(params.n):
        sample_prompt = prompt if index == params.n - 1 else _copy_prompt(prompt)
        completion, first_token_s = _decode(encoder, sample_prompt, params, index, started, prompt_tokens)
        completions.append(completion)
        if index == 0:
            ttft_ms = first_token_s * 1e3
    total_ms = (time.perf_counter() - started) * 1e3
    usage = Usage(prompt_tokens=plan.num_prompt_tokens, cached_tokens=plan.num_cached_tokens,
                  computed_tokens=prompt.num_computed_tokens,
                  completion_tokens=sum(len(c.token_ids) for c in completions))
    timings = Timings(encode_ms=prompt.encode_ms, assembly_ms=prompt.assembly_ms, lookup_ms=0.0,
                      prefill_ms=prompt.prefill_ms,
                      ttft_ms=ttft_ms, total_ms=total_ms)
    return GenerationResult(tuple(completions), usage, plan.is_exact, plan.approximations, prompt.modules, timings)


def _decode(encoder: ModuleEncoder, prompt: PrefilledPrompt, params: SamplingParams, index: int,
            started: float, prompt_tokens: PromptTokens | None) -> tuple[Completion, float]:
    loaded = encoder.loaded
    sampler = Sampler(params, seed_offset=index, prompt=prompt_tokens)
    detok = Detokenizer(loaded.tokenizer, params.stop)
    eos = set() if params.ignore_eos else set(loaded.eos_token_ids)
    logits, position = prompt.logits, prompt.next_position
    token_ids: list[int] = []
    first_token_s = 0.0
    finish = "length"
    while True:
        token = sampler.sample(logits)
        if not token_ids:
            first_token_s = time.perf_counter() - started
        token_ids.append(token)
        if token in eos:
            finish = "stop"
            break
        detok.push(token)
        if detok.is_stopped:
            finish = "stop"
            break
        if len(token_ids) >= params.max_tokens:
            break
        check_positions([position], loaded.max_positions)
        with torch.inference_mode():
            hidden = run_tokens(loaded.model, prompt.buffer, [token], [position])
            logits = logits_of(loaded.model, hidden)
        position += 1
    detok.flush()
    return Completion(index, detok.text, tuple(token_ids), finish), first_token_s


def _copy_prompt(prompt: PrefilledPrompt) -> PrefilledPrompt:
    return PrefilledPrompt(prompt.buffer.clone(), prompt.logits, prompt.next_position, prompt.modules,
                           prompt.num_computed_tokens, prompt.encode_ms, prompt.assembly_ms, prompt.prefill_ms)

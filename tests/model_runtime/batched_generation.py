"""The oracles the architecture tests share: a cached prefill in `exact` mode against HF's full forward, and batched
generation (every prompt submitted to one engine at once, so decode steps batch several sequences over shared module
KV), each greedy token against HF's own generation loop and each logprob against HF's forward over prompt + answer."""

from __future__ import annotations

import asyncio

import torch

from promptcache.model_runtime import ModelRuntime, SamplingParams
from promptcache.model_runtime.baseline import full_prefill_greedy, full_prefill_logits
from promptcache.model_runtime.engine import Engine, EngineConfig, Fidelity
from tests.model_runtime.engine_probe import first_step


def assert_exact_prefill_equals_hf(runtime: ModelRuntime, oracle: torch.nn.Module, prompts: list[str],
                                   exact: Fidelity, *, tolerance: float = 1e-4) -> None:
    """Each prompt's first-token logits in `exact` mode (modules from the store where a full prefill computes them
    identically, the rest prefilled over them) equal `oracle`'s forward of the whole prompt; some module KV is
    reused."""
    num_cached = 0
    for prompt in prompts:
        plan = runtime.plan(prompt)
        logits, final = first_step(runtime, plan, exact)
        reference = full_prefill_logits(oracle, plan.token_ids(), range(plan.num_prompt_tokens))[-1]
        assert (logits - reference).abs().max().item() <= tolerance, prompt
        assert final.report.cache.is_exact
        num_cached += final.report.usage.cached_tokens
    assert num_cached > 0  # module KV was reused, not only recomputed


def assert_batched_generation_equals_hf(runtime: ModelRuntime, oracle: torch.nn.Module, prompts: list[str], *,
                                        num_tokens: int, fidelity: Fidelity, tolerance: float = 1e-4) -> None:
    """Generate `num_tokens` greedy tokens for every prompt in one engine and compare with `oracle` (HF's model of the
    same weights, full prefill at positions 0..n-1). Fails unless some step decoded two sequences together."""
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None, max_num_seqs=4, fidelity=fidelity))
    batch_sizes: list[int] = []
    forward = engine.runner._forward  # every pass of a step goes through it

    def counted(entries, **kwargs):
        batch_sizes.append(sum(e.num_tokens == 1 for e in entries))  # the step's decoding sequences
        return forward(entries, **kwargs)

    engine.runner._forward = counted  # type: ignore[method-assign]
    plans = [runtime.plan(prompt) for prompt in prompts]
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True, logprobs=1)
    try:
        answers = asyncio.run(generate_together(engine, plans, params))
    finally:
        engine.stop()
    assert max(batch_sizes) >= 2, batch_sizes
    for plan, answer in zip(plans, answers):
        tokens = [token for token, _ in answer]
        positions = list(range(plan.num_prompt_tokens))
        assert tokens == full_prefill_greedy(oracle, plan.token_ids(), positions, num_tokens)
        rows = full_prefill_logits(oracle, [*plan.token_ids(), *tokens[:-1]],
                                   range(plan.num_prompt_tokens + num_tokens - 1))[plan.num_prompt_tokens - 1:]
        want = rows.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]  # [num_tokens]
        got = torch.tensor([logprob for _, logprob in answer])
        assert (got - want).abs().max().item() <= tolerance


async def generate_together(engine: Engine, plans, params: SamplingParams) -> list[list[tuple[int, float]]]:
    """Each plan's (token, logprob) pairs, the plans submitted in one step."""
    async def collect(stream) -> list[tuple[int, float]]:
        out = []
        async for event in stream:
            assert event.report is None or event.report.error is None, event.report
            if event.token_id is not None:
                out.append((event.token_id, event.logprobs.logprob))
        return out

    with engine.inbox.wakeup:  # admitted together: their decodes share steps
        streams = [engine.submit(plan, params) for plan in plans]
    return await asyncio.gather(*(collect(stream) for stream in streams))

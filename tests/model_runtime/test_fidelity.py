"""Fidelity modes in the engine against oracles: full prefill (exact), one explicit-mask forward pass
(every mode), stored module KV untouched (balanced), batched == alone (every mode)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.baseline import full_prefill_greedy, full_prefill_logits
from promptcache.model_runtime.engine import Engine, EngineConfig, Fidelity, resolve
from promptcache.model_runtime.engine.reuse_plan import in_context, realigned, recompute_selected
from tests.conftest import make_tiny_runtime
from tests.model_runtime.engine_probe import first_step
from tests.model_runtime.oracles import reuse_reference
from tests.model_runtime.test_exactness import APPROX_PROMPTS, APPROX_SCHEMA

SCHEMA = """<schema name="lib"><system>Answer from the documents only.</system>
  <user>
    <module name="d0">Zero: cats sleep most of the day and dream of fish.</module>
    <module name="d1">One: tea is brewed with hot water in a pot.</module>
    <module name="d2">Two: Rome was not built in a day, nor in a week.</module>
    <module name="d3">Three: the moon orbits the earth every month.</module>
  </user>
</schema>"""
PROMPTS = [
    '<prompt schema="lib"><user><d2/><d0/>Which documents mention time?</user><assistant/></prompt>',
    '<prompt schema="lib"><user><d0/><d1/>Who sleeps?</user><assistant/></prompt>',
    '<prompt schema="lib"><user><d3/>What orbits?</user><assistant/></prompt>',
]
MODES = [Fidelity("fast"), Fidelity("fast", positions="contiguous"), Fidelity("balanced", 2),
         Fidelity("balanced", 5), Fidelity("balanced", 2, "contiguous"), Fidelity("exact", positions="contiguous"),
         Fidelity("fast", positions="contiguous", context="predecessor"),
         Fidelity("balanced", 2, "contiguous", "predecessor")]
ARCHS = ["llama", "qwen2", "qwen3", "gpt2"]  # qwen3: keys normalised per head before RoPE, then moved
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _runtime(arch: str):
    runtime = make_tiny_runtime(arch)
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    runtime.add_schema(runtime.parse_schema(APPROX_SCHEMA.format(params="placeholder")))
    return runtime


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fidelity", MODES, ids=lambda f: f"{f.mode}-{f.head_tokens}-{f.positions}-{f.context}")
def test_every_mode_matches_its_explicit_mask_oracle(arch, fidelity):
    runtime = _runtime(arch)
    can_shift = runtime.loaded.key_shifter is not None
    assert can_shift == (arch != "gpt2")  # GPT-2's learned positions cannot be moved: it keeps the layout's
    realigned = 0
    for prompt in [*PROMPTS, *APPROX_PROMPTS]:
        plan = runtime.plan(prompt)
        reuse = resolve(plan, fidelity, can_shift=can_shift)
        realigned += reuse.positions == "contiguous"
        logits, final = first_step(runtime, plan, fidelity)
        tokens, positions, mask = reuse_reference(plan, reuse)
        reference = full_prefill_logits(runtime.loaded.model, tokens, positions, mask)[-1]
        assert (logits - reference).abs().max().item() <= 1e-4, prompt
        usage, cache = final.report.usage, final.report.cache
        assert cache.fidelity == fidelity.mode and usage.recomputed_tokens == reuse.num_recomputed
        assert usage.cached_tokens + usage.computed_tokens == plan.num_prompt_tokens
        assert cache.positions == reuse.positions and cache.context == reuse.context
    moves = can_shift and fidelity.mode != "exact" and fidelity.positions == "contiguous"
    assert (realigned > 0) == moves  # the prompts include approximate ones with gaps: the oracle saw shifts


@pytest.mark.parametrize("arch", ARCHS)
def test_exact_equals_a_plain_full_prefill(arch):
    runtime = _runtime(arch)
    model = runtime.loaded.model
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    try:
        for prompt in [*PROMPTS, *APPROX_PROMPTS]:
            plan = runtime.plan(prompt)
            contiguous = list(range(plan.num_prompt_tokens))
            logits, final = first_step(runtime, plan, Fidelity("exact"))
            reference = full_prefill_logits(model, plan.token_ids(), contiguous)[-1]
            assert (logits - reference).abs().max().item() <= 1e-4, prompt
            assert final.report.cache.is_exact
            tokens = asyncio.run(_tokens(engine, plan, params, Fidelity("exact")))
            assert tokens == full_prefill_greedy(model, plan.token_ids(), contiguous, 10)
    finally:
        engine.stop()


def test_balanced_recomputes_what_it_reports_and_never_writes_back():
    runtime = _runtime("llama")
    plan = runtime.plan(PROMPTS[0])  # d0 is positioned before d2 (layout order), but d2 was encoded without it
    encoder, store = runtime.module_encoder, runtime.module_encoder.store
    keys = [encoder.key(plan.schema, c.segment.segment_id, c.context_ids, None) for c in plan.cached]
    before = [store.get(k)[0].keys.clone() for k in keys]
    reuse = resolve(plan, Fidelity("balanced", 3))
    out_of_context = [c for c in plan.cached if not in_context(plan, c)]
    assert out_of_context and reuse.num_recomputed == sum(min(3, len(c.segment.token_ids)) for c in out_of_context)
    _, final = first_step(runtime, plan, Fidelity("balanced", 3))
    reported = {m.path: m.num_recomputed for m in final.report.cache.modules}
    assert sum(reported.values()) == final.report.usage.recomputed_tokens == reuse.num_recomputed
    assert reported == {"d2": 3, "d0": 0}
    assert not final.report.cache.is_exact
    for key, old in zip(keys, before):
        assert torch.equal(store.get(key)[0].keys, old)  # the module's stored KV is never overwritten


@pytest.mark.parametrize("contiguous", [False, True], ids=["layout", "contiguous"])
def test_any_selection_of_recomputed_tokens_matches_its_oracle(contiguous):
    """Recomputing tokens anywhere in a module (CacheBlend's or a query-aware selection, not only the
    head) splits its stored KV into runs the stream attends around: the engine computes the oracle's
    logits, reports exactly those tokens, and the head selection is `balanced` itself."""
    runtime = _runtime("llama")
    plan = runtime.plan(PROMPTS[0])  # d2 then d0: d2 was encoded without d0 before it
    heads = {i: range(3) for i, c in enumerate(plan.cached) if not in_context(plan, c)}
    assert recompute_selected(plan, heads, "balanced:3") == resolve(plan, Fidelity("balanced", 3))
    lengths = [len(c.segment.token_ids) for c in plan.cached]
    chosen = {i: [1, 2, lengths[i] // 2, lengths[i] - 1] for i in heads}  # a middle token and the last
    selected = recompute_selected(plan, chosen, "selected")
    assert len(selected.uses) == len(plan.cached) + 2 * len(chosen)  # each chosen module reused in 3 runs
    reused = [u.cached.segment.position_ids[j] for u in selected.uses for j in range(u.first, u.last)]
    assert sorted(reused + list(selected.position_ids)) == sorted(plan.position_ids())  # each token once
    assert selected.num_recomputed == 4 * len(chosen)
    for use in selected.uses:  # a run is visible to exactly the stream tokens positioned after it
        last = use.cached.segment.position_ids[use.last - 1]
        assert all((k >= use.visible_from) == (p > last) for k, p in enumerate(selected.position_ids))
    reuse = realigned(selected) if contiguous else selected
    logits, final = first_step(runtime, plan, Fidelity("balanced"), reuse=reuse)
    tokens, positions, mask = reuse_reference(plan, reuse)
    reference = full_prefill_logits(runtime.loaded.model, tokens, positions, mask)[-1]
    assert (logits - reference).abs().max().item() <= 1e-4
    assert final.report.usage.recomputed_tokens == 4 * len(chosen)
    assert final.report.usage.cached_tokens + final.report.usage.computed_tokens == plan.num_prompt_tokens


def test_in_context_prompt_is_identical_in_every_mode():
    runtime = _runtime("llama")
    plan = runtime.plan(PROMPTS[2])  # d3 alone: encoded after exactly the text before it (a gap is fine)
    assert plan.is_exact
    fast = resolve(plan, Fidelity("fast"))
    balanced = resolve(plan, Fidelity("balanced", 4))
    assert balanced.num_recomputed == 0 and balanced.variant == "" and balanced.token_ids == fast.token_ids
    exact = resolve(plan, Fidelity("exact"))  # a full prefill has no gap: d3 moves, so it is recomputed
    assert dict(exact.recomputed) == {"d3": len(plan.schema.segments_of("d3")[0].token_ids)}
    assert exact.position_ids == tuple(range(exact.position_ids[0], plan.num_prompt_tokens))


def test_batched_equals_alone_for_each_mode():
    runtime = _runtime("llama")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    jobs = [(runtime.plan(p), m) for p in [*PROMPTS, *APPROX_PROMPTS] for m in MODES]
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None, max_num_seqs=8))

    async def together():
        return await asyncio.gather(*[_tokens(engine, plan, params, mode) for plan, mode in jobs])

    try:
        alone = [asyncio.run(_tokens(engine, plan, params, mode)) for plan, mode in jobs]
        batched = asyncio.run(together())
    finally:
        engine.stop()
    assert batched == alone


async def _tokens(engine: Engine, plan, params: SamplingParams = GREEDY, fidelity: Fidelity | None = None) -> list[int]:
    tokens = []
    async for event in engine.submit(plan, params, fidelity=fidelity):
        assert event.report is None or event.report.error is None, event.report
        if event.token_id is not None:
            tokens.append(event.token_id)
    return tokens


def _oracle_greedy(model, plan, reuse, num_tokens: int) -> list[int]:
    """Greedy tokens by the explicit-mask oracle: each generated token is one more stream row, at the
    next position, seeing what the last prompt row sees and every generated row before it."""
    tokens, positions, mask = reuse_reference(plan, reuse)
    mask = mask[0, 0]
    out: list[int] = []
    for step in range(num_tokens):
        token = int(full_prefill_logits(model, tokens, positions, mask[None, None])[-1].argmax())
        out.append(token)
        n = len(tokens)
        grown = torch.zeros((n + 1, n + 1), dtype=torch.bool)
        grown[:n, :n] = mask
        grown[n, :n] = mask[n - 1]
        grown[n, n] = True
        tokens, positions, mask = [*tokens, token], [*positions, reuse.next_position + step], grown
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_contiguous_positions_decode_like_the_oracle_and_never_write_back(arch):
    runtime = _runtime(arch)
    encoder, store = runtime.module_encoder, runtime.module_encoder.store
    engine = Engine(encoder, EngineConfig(prefix=None))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    try:
        for prompt in [PROMPTS[0], *APPROX_PROMPTS]:
            plan = runtime.plan(prompt)
            keys = [encoder.key(plan.schema, c.segment.segment_id, c.context_ids, None) for c in plan.cached]
            before = [store.get(k)[0].keys.clone() for k in keys]
            for fidelity in (Fidelity("fast", positions="contiguous"), Fidelity("balanced", 2, "contiguous")):
                reuse = resolve(plan, fidelity)
                assert reuse.positions == "contiguous" and any(u.shift for u in reuse.uses), prompt
                assert reuse.next_position == plan.num_prompt_tokens  # no gaps left
                tokens = asyncio.run(_tokens(engine, plan, params, fidelity))
                assert tokens == _oracle_greedy(runtime.loaded.model, plan, reuse, 6), (prompt, fidelity)
                two = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=2)
                assert asyncio.run(_samples(engine, plan, two, fidelity)) == [tokens, tokens]
            for key, old in zip(keys, before):
                assert torch.equal(store.get(key)[0].keys, old)  # shifted keys serve the request only
    finally:
        engine.stop()


async def _samples(engine: Engine, plan, params: SamplingParams, fidelity: Fidelity) -> list[list[int]]:
    samples: list[list[int]] = [[] for _ in range(params.n)]
    async for event in engine.submit(plan, params, fidelity=fidelity):
        assert event.report is None or event.report.error is None, event.report
        if event.token_id is not None:
            samples[event.index].append(event.token_id)
    return samples

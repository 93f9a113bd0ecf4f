"""Sliding-window attention (Mistral in every layer; Qwen2 and Gemma 3 with local and full layers mixed) against Hugging
Face's own forward of an untouched twin of the same random weights: cached prefill and `exact` module reuse, batched
decode over shared modules and greedy generation past the window, chunked prefill, forked samples and prefix blocks;
`fast` reuse at discontinuous positions against HF's forward under explicit masks; the windowed attention against plain
masked attention over discontinuous positions; KV out of every query's reach is never read on a local layer;
deterministic serving's same bits however a windowed prompt is served."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, Phi3Config, Qwen2Config

from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, SamplingParams, UnsupportedModelError, wrap_model
from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.attention.sliding_window import WindowedPass
from promptcache.model_runtime.baseline import full_prefill_greedy, full_prefill_logits
from promptcache.model_runtime.engine import Engine, EngineConfig, Fidelity, resolve
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.loading import torch_layer_ops
from promptcache.model_runtime.loading.architectures import check_architecture, layer_windows
from promptcache.model_runtime.loading.fused_layers import fuse_layers
from promptcache.model_runtime.packed_attention import ATTENTION_NAME
from tests.model_factories import make_test_tokenizer, tiny_config
from tests.model_runtime.batched_generation import assert_batched_generation_equals_hf, assert_exact_prefill_equals_hf
from tests.model_runtime.engine_probe import first_step
from tests.model_runtime.oracles import reuse_reference
from tests.model_runtime.test_deterministic import GREEDY as DETERMINISTIC_GREEDY
from tests.model_runtime.test_deterministic import Harness
from tests.model_runtime.test_fidelity import PROMPTS, SCHEMA
from tests.model_runtime.test_gemma3 import LAYER_TYPES as GEMMA3_LAYER_TYPES
from tests.model_runtime.test_gemma3 import make_tiny_gemma3, tiny_gemma3_config

WINDOW = 8  # far shorter than the prompts (~40 tokens)
EXACT = Fidelity("exact")
NUM_TOKENS = 12
ARCHS = ["mistral", "qwen2", "gemma3"]
LAYERS = ["hf", "fused", "deterministic"]
# Gemma 3 is served by HF's modules only: nothing to fuse, deterministic serving refused.
SERVED = [(arch, layers) for arch in ARCHS[:2] for layers in LAYERS] + [("gemma3", "hf")]
WINDOWS = {"mistral": (WINDOW, WINDOW), "qwen2": (WINDOW, None),
           "gemma3": tuple(WINDOW if kind == "sliding_attention" else None for kind in GEMMA3_LAYER_TYPES)}


def _config(arch: str, window: int | None = WINDOW):
    if arch == "gemma3":  # layers 0 and 1 slide, 2 attends in full; no window: one as long as its positions
        return tiny_gemma3_config(len(make_test_tokenizer()), sliding_window=window or 2048)
    config = tiny_config(arch, vocab_size=len(make_test_tokenizer()))
    if arch == "mistral":
        config.sliding_window = window
    else:  # layer 0 slides, layer 1 attends in full
        config = Qwen2Config(**{k: v for k, v in config.to_dict().items() if k in _QWEN2_KEYS},
                             use_sliding_window=window is not None, sliding_window=window,
                             layer_types=["sliding_attention" if window else "full_attention", "full_attention"])
    return config


_QWEN2_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings", "initializer_range")


def _model(config) -> torch.nn.Module:
    if config.model_type == "gemma3_text":  # its (1 + w) norms drawn too
        return make_tiny_gemma3(config.vocab_size, sliding_window=config.sliding_window)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _served(arch: str, layers: str, request: pytest.FixtureRequest) -> tuple[ModelRuntime, torch.nn.Module]:
    """(a runtime over the tiny windowed `arch` model with schema `lib` and `layers`, an untouched HF twin: the
    oracle). Deterministic layers need the batch-invariant kernels (skipped where they cannot be built)."""
    if layers == "deterministic":
        request.getfixturevalue("deterministic_kernels")
    served = _model(_config(arch))
    oracle = AutoModelForCausalLM.from_config(served.config, attn_implementation="sdpa").eval()
    oracle.load_state_dict(served.state_dict())
    if layers == "fused":  # torch's ops: what a GPU runs
        assert fuse_layers(served, torch_layer_ops) > 0
    loaded = wrap_model(served, make_test_tokenizer(), name=f"tiny-{arch}-window-{layers}",
                        deterministic=layers == "deterministic")
    assert loaded.layer_windows == WINDOWS[arch]
    runtime = ModelRuntime(loaded, build_store(StoreConfig()))
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    return runtime, oracle


def test_layer_windows_follow_sliding_window_and_layer_types():
    assert layer_windows(_config("mistral")) == (WINDOW, WINDOW)
    assert layer_windows(_config("mistral", None)) == (None, None)
    assert layer_windows(_config("qwen2")) == (WINDOW, None)
    assert layer_windows(_config("qwen2", None)) == (None, None)
    assert layer_windows(_config("gemma3")) == WINDOWS["gemma3"]
    assert layer_windows(_config("gemma3", None)) == (None,) * len(GEMMA3_LAYER_TYPES)
    assert layer_windows(tiny_config("qwen2", vocab_size=64)) == (None, None)
    common = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048)
    assert layer_windows(Phi3Config(**common, pad_token_id=None, sliding_window=16)) == (16, 16)
    assert layer_windows(Phi3Config(**common, pad_token_id=None, sliding_window=2048)) == (None, None)  # never cuts
    gemma = Gemma3TextConfig(**common, sliding_window=32, layer_types=["sliding_attention", "full_attention"])
    assert layer_windows(gemma) == (32, None)
    check_architecture(_config("mistral"))  # accepted now
    capped = _config("mistral")
    capped.attn_logit_softcapping = 50.0
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping"):
        check_architecture(capped)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_oracle_slides(arch):
    """HF's own forward honours the window on these prompts (else the tests below could not fail)."""
    windowed, full = _model(_config(arch)), _model(_config(arch, None))
    full.load_state_dict(windowed.state_dict())
    runtime, _ = _served(arch, "hf", None)  # type: ignore[arg-type]
    plan = runtime.plan(PROMPTS[0])
    assert plan.num_prompt_tokens > 3 * WINDOW
    ids, positions = plan.token_ids(), range(plan.num_prompt_tokens)
    difference = full_prefill_logits(windowed, ids, positions) - full_prefill_logits(full, ids, positions)
    assert difference.abs().max() > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_forward_outside_a_batch_step_keeps_hf_s_window(request, arch):
    """The served model's own forward outside a batch step (promptcache's attention installed, HF's sliding mask)."""
    runtime, oracle = _served(arch, "hf", request)
    ModelRunner(runtime.loaded)  # installs promptcache's attention function
    assert runtime.loaded.model.config._attn_implementation == ATTENTION_NAME
    ids = runtime.plan(PROMPTS[0]).token_ids()
    got = full_prefill_logits(runtime.loaded.model, ids)
    torch.testing.assert_close(got, full_prefill_logits(oracle, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("arch", "layers"), SERVED)
def test_cached_prefill_and_exact_module_reuse_equal_the_hf_forward(request, arch, layers):
    """First-token logits in `exact` mode (modules from the store, the rest prefilled over them) equal HF's forward."""
    runtime, oracle = _served(arch, layers, request)
    assert_exact_prefill_equals_hf(runtime, oracle, PROMPTS, EXACT)


@pytest.mark.parametrize(("arch", "layers"), SERVED)
def test_batched_decode_and_greedy_generation_past_the_window_equal_the_hf_forward(request, arch, layers):
    """All prompts in one engine (`exact`): decode steps batch several sequences over shared modules, generating past
    the window; every greedy token and its logprob equal HF's."""
    runtime, oracle = _served(arch, layers, request)
    assert_batched_generation_equals_hf(runtime, oracle, PROMPTS, num_tokens=NUM_TOKENS, fidelity=EXACT)


@pytest.mark.parametrize("fidelity", [Fidelity("fast"), Fidelity("fast", positions="contiguous")])
@pytest.mark.parametrize("arch", ARCHS)
def test_module_reuse_at_discontinuous_positions_equals_the_masked_forward(request, arch, fidelity):
    """`fast` reuse (modules at their layout positions, with gaps, or moved): HF's forward with the reuse oracle's mask
    AND the window by each row's position on local layers, the oracle's mask alone on full ones (one mask per layer
    type: transformers' mapping), computes what the engine does."""
    runtime, oracle = _served(arch, "hf", request)
    for prompt in PROMPTS:
        plan = runtime.plan(prompt)
        logits, _ = first_step(runtime, plan, fidelity)
        tokens, positions, mask = reuse_reference(plan, resolve(plan, fidelity))
        where = torch.tensor(positions)
        windowed = mask & (where[:, None] - where[None, :] < WINDOW)  # [1, 1, n, n]: rows query, columns key
        assert not torch.equal(windowed, mask)
        masks = windowed if arch == "mistral" else {"sliding_attention": windowed, "full_attention": mask}
        reference = full_prefill_logits(oracle, tokens, positions, masks)[-1]
        assert (logits - reference).abs().max().item() <= 1e-4, prompt


# Unit tests of the windowed attention: 2 layers (0 slides), KV heads 2, query heads 4, head_dim 8.
H_KV, H, D, L = 2, 4, 8, 2


def _pass(window: int, *, per_row: bool = False, poison: bool = False):
    """Two sequences over discontinuous positions: segment A [0..5] and B [20..29] shared (sequence 1 from its row 2
    on), segment C [40..43] sequence 0's alone; own KV of each continues elsewhere. Returns the pass, queries and the
    explicit oracle's output."""
    gen = torch.Generator().manual_seed(1)
    seg_pos = [torch.arange(0, 6), torch.arange(20, 30), torch.arange(40, 44)]
    members = [((0, 1), None), ((0, 1), (0, 2)), ((0,), None)]
    segments = [(torch.randn(L, H_KV, p.numel(), D, generator=gen), torch.randn(L, H_KV, p.numel(), D, generator=gen),
                 m, o) for p, (m, o) in zip(seg_pos, members)]
    # sequence 0: own prefix at 44..45, queries at 50..52; sequence 1 decodes at 60 after own 31..33 (a prefill of 4,
    # its first two queries precede segment B: row offsets).
    own_pos = [torch.tensor([44, 45, 50, 51, 52]), torch.tensor([31, 32, 33, 60])]
    query_pos = [torch.tensor([50, 51, 52]), torch.tensor([31, 32, 33, 60])]
    own = [(torch.randn(L, H_KV, p.numel(), D, generator=gen), torch.randn(L, H_KV, p.numel(), D, generator=gen))
           for p in own_pos]
    queries = torch.randn(7, H, D, generator=gen)
    expected = torch.empty_like(queries)
    row = 0
    for seq, q_pos in enumerate(query_pos):
        keys, values, pos, visible = [], [], [], []
        for (k, v, m, o), p in zip(segments, seg_pos):
            if seq in m:
                first = o[m.index(seq)] if o else 0
                keys.append(k[0]), values.append(v[0]), pos.append(p)
                visible.append((torch.arange(q_pos.numel()) >= first)[:, None].expand(-1, p.numel()))
        n = own_pos[seq].numel()
        keys.append(own[seq][0][0]), values.append(own[seq][1][0]), pos.append(own_pos[seq])
        visible.append(torch.arange(n)[None, :] - (n - q_pos.numel()) <= torch.arange(q_pos.numel())[:, None])
        k_pos = torch.cat(pos)
        mask = torch.cat(visible, dim=1) & (q_pos[:, None] - k_pos[None, :] < window)
        k = torch.cat(keys, 1).double().repeat_interleave(2, 0)                          # [H, m, D]
        v = torch.cat(values, 1).double().repeat_interleave(2, 0)
        q = queries[row: row + q_pos.numel()].double().transpose(0, 1)                    # [H, T, D]
        scores = (q @ k.transpose(1, 2) * D ** -0.5).masked_fill(~mask, float("-inf"))  # [H, T, m]
        expected[row: row + q_pos.numel()] = (scores.softmax(-1) @ v).transpose(0, 1).float()
        row += q_pos.numel()
    if poison:  # keys at or before every member's first query position - window: local-layer KV made NaN
        reach = [int(q.min()) - window for q in query_pos]
        for (k, v, m, _), p in zip(segments, seg_pos):
            out_of_reach = p <= min(reach[seq] for seq in m)
            k[0, :, out_of_reach], v[0, :, out_of_reach] = float("nan"), float("nan")
        for (k, v), p, low in zip(own, own_pos, reach):
            k[0, :, p <= low], v[0, :, p <= low] = float("nan"), float("nan")
    window_pass = WindowedPass((window, None), query_pos, own_pos, segments, seg_pos, per_row=per_row)

    def own_kv(layer):
        return [k[layer] for k, _ in own], [v[layer] for _, v in own]

    return window_pass, queries, own_kv, expected


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("window", [4, 12, 25, 100])
def test_windowed_attention_equals_plain_masked_attention(window, per_row):
    window_pass, queries, own_kv, expected = _pass(window, per_row=per_row)
    assert window_pass.cuts(0) == (per_row or window <= 60) and not window_pass.cuts(1)
    got = window_pass.attend(queries, 0, own_kv, D ** -0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("window", [8, 12])
def test_kv_out_of_reach_is_not_read_on_local_layers(window, per_row):
    """Segment A (positions 0..5) lies beyond every query's reach, B (20..29) and own KV partly: with that local-layer
    KV set to NaN, the output is finite and unchanged (a key read, even masked, would spread NaN)."""
    window_pass, queries, own_kv, expected = _pass(window, per_row=per_row, poison=True)
    got = window_pass.attend(queries, 0, own_kv, D ** -0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not bf16_kernel.supported(), reason="this CPU lacks AVX512-BF16")
@pytest.mark.parametrize("case", ["cold", "continued", "blocks out of order", "gap", "offset"])
def test_bf16_keys_at_consecutive_positions_take_the_kernels_band(bf16_kernels, monkeypatch, case):
    """In bf16, a sequence whose gathered keys lie at consecutive positions ending at its last query's (a cold prefill;
    new text after a cached segment it continues, its blocks stored in any order, as an assembled group's may be) is
    attended by the bf16 kernel's causal band, one call; a gap in the positions, or a segment hidden from the first
    rows (a row offset), keeps the masked path. Each against float64 softmax attention under the visibility and window
    mask, within bf16 rounding."""
    d, window, num_q = 64, 100, 300
    gen = torch.Generator().manual_seed(3)
    seg_len = 0 if case == "cold" else 250
    seg_pos = torch.arange(seg_len)
    if case == "blocks out of order":  # the segment's second half stored first
        seg_pos = torch.cat([seg_pos[seg_len // 2:], seg_pos[: seg_len // 2]])
    own_pos = torch.arange(num_q) + seg_len + (7 if case == "gap" else 0)
    offset = 5 if case == "offset" else 0
    segments = [(torch.randn(1, H_KV, seg_len, d, generator=gen).bfloat16(),
                 torch.randn(1, H_KV, seg_len, d, generator=gen).bfloat16(), (0,), (offset,))] if seg_len else []
    own = [torch.randn(1, H_KV, num_q, d, generator=gen).bfloat16() for _ in range(2)]
    queries = torch.randn(num_q, H, d, generator=gen).bfloat16()
    calls: list[int] = []
    kernel = bf16_kernel.loaded()
    assert kernel is not None
    monkeypatch.setitem(bf16_kernel._state, "kernel", lambda *args: calls.append(1) or kernel(*args))
    window_pass = WindowedPass((window,), [own_pos], [own_pos], segments, [seg_pos] if seg_len else [])
    got = window_pass.attend(queries, 0, lambda layer: ([own[0][layer]], [own[1][layer]]), d ** -0.5)
    assert len(calls) == (1 if case in ("cold", "continued", "blocks out of order") else 0)
    rows, keys = torch.arange(num_q)[:, None], torch.arange(seg_len + num_q)[None, :]
    k_pos = torch.cat([seg_pos, own_pos])
    visible = (keys <= seg_len + rows) & ((keys >= seg_len) | (rows >= offset))
    mask = visible & (own_pos[:, None] - k_pos[None, :] < window)
    k = torch.cat([s[0][0] for s in segments] + [own[0][0]], 1).double().repeat_interleave(H // H_KV, 0)
    v = torch.cat([s[1][0] for s in segments] + [own[1][0]], 1).double().repeat_interleave(H // H_KV, 0)
    scores = (queries.double().transpose(0, 1) @ k.transpose(1, 2) * d ** -0.5).masked_fill(~mask, float("-inf"))
    expected = (scores.softmax(-1) @ v).transpose(0, 1)
    assert (got.double() - expected).abs().max().item() <= 3e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_forked_samples_and_reused_prefix_blocks_equal_the_hf_forward(request, arch):
    """A prompt prefilled in chunks of 8 (own KV at positions earlier chunks fed), forked into n=2 samples (the prompt's
    KV shared at its real positions), served twice (the second time from stored prefix blocks): every sample's greedy
    tokens are HF's."""
    runtime, oracle = _served(arch, "hf", request)
    engine = Engine(runtime.module_encoder, EngineConfig(max_prefill_tokens=8, max_prefill_tokens_alone=8,
                                                         min_prefill_tokens=4, fidelity=EXACT))
    plan = runtime.plan(PROMPTS[1])
    want = full_prefill_greedy(oracle, plan.token_ids(), list(range(plan.num_prompt_tokens)), NUM_TOKENS)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, n=2)

    async def samples() -> dict[int, list[int]]:
        found: dict[int, list[int]] = {0: [], 1: []}
        async for event in engine.submit(plan, params):
            assert event.report is None or event.report.error is None, event.report
            if event.token_id is not None:
                found[event.index].append(event.token_id)
        return found

    try:
        for _ in range(2):
            assert asyncio.run(samples()) == {0: want, 1: want}
    finally:
        engine.stop()


@pytest.mark.parametrize("arch", ARCHS[:2])
def test_deterministic_serving_gives_the_same_bits_cold_warm_chunked_and_batched(engines, deterministic_kernels, arch):
    """A windowed model under deterministic serving (local-layer rows each over exactly their window): 16 prompts
    (plain and over cached modules, ~50 tokens) answer the same bits cold, warm, in chunks of 5 and all together."""
    loaded = wrap_model(_model(_config(arch)), make_test_tokenizer(), name=f"tiny-{arch}-window", deterministic=True)
    alone = engines(Harness, loaded=loaded)
    plans = alone.plans()
    cold = [alone.alone(plan, DETERMINISTIC_GREEDY) for plan in plans]
    assert [alone.alone(plan, DETERMINISTIC_GREEDY) for plan in plans] == cold  # prefix blocks and cached logits
    chunked = engines(Harness, loaded=loaded, max_prefill_tokens=5, max_prefill_tokens_alone=5, min_prefill_tokens=1)
    assert [chunked.alone(plan, DETERMINISTIC_GREEDY) for plan in plans[::3]] == cold[::3]
    assert engines(Harness, loaded=loaded).together(plans, DETERMINISTIC_GREEDY) == cold


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("window", [64, 300])
def test_a_long_pass_attends_its_window_in_query_blocks(window, shuffled):
    """A prefill of 700 tokens (more than one QUERY_BLOCK) on a local layer, blocks of rows each over only the keys
    they see (a run of keys in position order as views; keys at shuffled positions, as a plan's discontinuous
    positions may place them, gathered), equals float64 softmax attention under the causal window mask."""
    from promptcache.model_runtime.attention.sliding_window import QUERY_BLOCK

    num = 700
    assert num > 2 * QUERY_BLOCK
    gen = torch.Generator().manual_seed(7)
    positions = (torch.randperm(num, generator=gen) if shuffled else torch.arange(num)) + 5
    own = (torch.randn(L, H_KV, num, D, generator=gen), torch.randn(L, H_KV, num, D, generator=gen))
    queries = torch.randn(num, H, D, generator=gen)
    window_pass = WindowedPass((window, None), [positions], [positions], [], [])
    got = window_pass.attend(queries, 0, lambda layer: ([own[0][layer]], [own[1][layer]]), D ** -0.5)
    order = torch.arange(num)  # causal in the pass's row order; the window on positions
    mask = (order[None, :] <= order[:, None]) & (positions[:, None] - positions[None, :] < window)
    k, v = (t[0].double().repeat_interleave(H // H_KV, 0) for t in own)  # [H, n, D]
    scores = (queries.double().transpose(0, 1) @ k.transpose(1, 2) * D ** -0.5).masked_fill(~mask, float("-inf"))
    expected = (scores.softmax(-1) @ v).transpose(0, 1).float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

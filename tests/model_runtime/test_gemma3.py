"""Gemma 3's text model (gemma3_text) through the engine, against Hugging Face's own forward of an untouched twin of
the same random weights: cached prefill and `exact` module reuse (first-token logits), batched decode over shared
module KV and greedy generation (every token and its logprob), module KV moved to other positions (`fast`,
contiguous) against the explicit-mask oracle. KeyShifter rotates each layer's keys with its layer type's RoPE base.
The tiny model has both layer types, a head wider than hidden / heads, `query_pre_attn_scalar` != head_dim and
non-zero (1 + w) norms; its window (256) is longer than every prompt here (test_sliding_window serves it with a window
of 8 that cuts). What is not implemented is refused at the config."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3Config, Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, UnsupportedModelError, wrap_model
from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.baseline import full_prefill_logits
from promptcache.model_runtime.engine import Fidelity, resolve
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.engine.static_step import static_forward_supported
from promptcache.model_runtime.errors import ModelLoadError
from promptcache.model_runtime.loading import torch_layer_ops
from promptcache.model_runtime.loading.architectures import check_architecture, layer_windows
from promptcache.model_runtime.loading.fused_layers import fuse_layers
from promptcache.model_runtime.rope_shift import KeyShifter
from tests.model_factories import make_test_tokenizer
from tests.model_runtime.batched_generation import assert_batched_generation_equals_hf, assert_exact_prefill_equals_hf
from tests.model_runtime.engine_probe import first_step
from tests.model_runtime.oracles import reuse_reference
from tests.model_runtime.test_fidelity import PROMPTS, SCHEMA

EXACT = Fidelity("exact")
NUM_TOKENS = 10
HEAD_DIM = 32
WINDOW = 256  # longer than every prompt here: the local layers' window cuts nothing
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"]


def tiny_gemma3_config(vocab_size: int, **changes) -> Gemma3TextConfig:
    """Gemma 3's shape in small: local and global layers with their own RoPE bases (10K, 1M), heads of 32 over a
    hidden size of 64 with 4 heads (Gemma's heads are wider than hidden / heads too), GQA, scaling by 24^-0.5."""
    settings = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYER_TYPES),
                    num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, query_pre_attn_scalar=24,
                    layer_types=LAYER_TYPES, sliding_window=WINDOW, max_position_embeddings=2048,
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
                    initializer_range=0.1, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    return Gemma3TextConfig(**{**settings, **changes})


def make_tiny_gemma3(vocab_size: int, seed: int = 0, **changes) -> torch.nn.Module:
    """A random-weight Gemma3ForCausalLM (config `changes` applied) whose RMSNorm weights are drawn too (HF starts them
    at 0: 1 + w = 1)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_gemma3_config(vocab_size, **changes), dtype=torch.float32,
                                                 attn_implementation="sdpa")
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.normal_(0.0, 0.3)
    return model.eval()


def _served(model: torch.nn.Module | None = None) -> tuple[ModelRuntime, torch.nn.Module]:
    """(a runtime over the tiny Gemma 3 with schema `lib`, an untouched HF twin of its weights: the oracle)."""
    tokenizer = make_test_tokenizer()
    served = model if model is not None else make_tiny_gemma3(len(tokenizer))
    oracle = AutoModelForCausalLM.from_config(served.config, attn_implementation="sdpa").eval()
    oracle.load_state_dict(served.state_dict())
    loaded = wrap_model(served, tokenizer, name="tiny-gemma3", pack_weights=True, fuse_layers=True)
    runtime = ModelRuntime(loaded, build_store(StoreConfig()))
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    return runtime, oracle


def test_its_decoder_stack_stays_hf_with_nothing_static():
    """Embedding scale, the decoder layers and the per-type RoPE stay the HF modules' (its norms, attention blocks and
    MLPs are fused in fp32 with the AVX2 library, below; the Llama-family fusion never takes it): no fused stack or
    static step replaces them; the whole context is served, local layers through their window."""
    tokenizer = make_test_tokenizer()
    model = make_tiny_gemma3(len(tokenizer))
    assert fuse_layers(model, torch_layer_ops) == 0
    loaded = wrap_model(model, tokenizer, name="tiny-gemma3", pack_weights=True, fuse_layers=True)
    runner = ModelRunner(loaded)
    assert runner.stack is None and runner.decode_stack is None and runner.graphs is None
    assert not static_forward_supported(loaded.model)
    assert loaded.max_positions == model.config.max_position_embeddings
    assert WINDOW in loaded.layer_windows and None in loaded.layer_windows == layer_windows(model.config)
    assert loaded.key_shifter is not None and loaded.key_shifter.is_per_layer


def test_its_modules_are_fused_in_fp32_with_the_avx2_library(avx2_kernels):
    """In fp32 where the AVX2 library is loaded every Gemma3RMSNorm ((1 + w) times the normalised x) becomes one fused
    pass and every attention block and MLP its fused twin (q|k|v and gate|up joined, q/k normalised per head and
    rotated in one pass each), computing what HF's modules compute (sums in another order: within a few ulps). The
    oracle tests above and below then serve through them."""
    from promptcache.model_runtime.loading.fused_gemma import (
        FusedGemmaAttention,
        FusedGemmaMLP,
        FusedGemmaRMSNorm,
        fuse_gemma,
    )

    model = make_tiny_gemma3(len(make_test_tokenizer()))
    twin = make_tiny_gemma3(len(make_test_tokenizer()))
    norms = {name: module for name, module in model.named_modules() if type(module).__name__ == "Gemma3RMSNorm"}
    num_norms = 4 * len(LAYER_TYPES) + 2 * len(LAYER_TYPES) + 1
    assert fuse_layers(model) == 0 and fuse_gemma(model) == len(norms) + 2 * len(LAYER_TYPES) == num_norms + 6
    modules = dict(model.named_modules())
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)) * 3
    for name, norm in norms.items():
        fused = modules[name]
        assert isinstance(fused, FusedGemmaRMSNorm)
        inputs = x if norm.weight.numel() == 64 else x[..., :HEAD_DIM].transpose(0, 1)  # q/k norms: strided heads
        want = norm(inputs)
        torch.testing.assert_close(fused(inputs), want, rtol=2e-6, atol=2e-6 * want.abs().max().item())
    layers = model.model.layers
    assert all(isinstance(layer.self_attn, FusedGemmaAttention) and isinstance(layer.mlp, FusedGemmaMLP)
               for layer in layers)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(ids).logits, twin(ids).logits  # every layer type's RoPE, window and norms
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.skipif(not bf16_kernel.supported(), reason="this CPU lacks AVX512-BF16")
def test_its_modules_are_fused_in_bf16_with_the_bf16_kernels(bf16_kernels):
    """In bf16 every Gemma3RMSNorm upcasts, normalises, scales by (1 + w) and rounds once as HF's does (the bf16
    kernels' norm: its sum of squares in another order, so a last bf16 bit may differ at a rounding tie), the attention
    blocks rotate with the bf16 kernel's RoPE and the joined projections multiply the same weights: logits of the
    whole model within a bf16 step of HF's twin in bf16 (equal here), and the served model fuses them at load."""
    from promptcache.model_runtime.loading.fused_gemma import (
        Bf16GemmaOps,
        FusedGemmaAttention,
        FusedGemmaMLP,
        FusedGemmaRMSNorm,
        fuse_gemma,
    )

    model = make_tiny_gemma3(len(make_test_tokenizer())).to(torch.bfloat16)
    twin = make_tiny_gemma3(len(make_test_tokenizer())).to(torch.bfloat16)
    norms = {name: module for name, module in twin.named_modules() if type(module).__name__ == "Gemma3RMSNorm"}
    assert fuse_gemma(model) == len(norms) + 2 * len(LAYER_TYPES)
    modules = dict(model.named_modules())
    x = (torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    for name, norm in norms.items():
        fused = modules[name]
        assert isinstance(fused, FusedGemmaRMSNorm) and isinstance(fused.ops, Bf16GemmaOps)
        inputs = x if norm.weight.numel() == 64 else x[..., :HEAD_DIM].transpose(0, 1)  # q/k norms: strided heads
        want = norm(inputs).float()
        torch.testing.assert_close(fused(inputs).float(), want, rtol=2.0 ** -8, atol=1e-6 * want.abs().max().item())
    assert all(isinstance(layer.self_attn, FusedGemmaAttention) and isinstance(layer.mlp, FusedGemmaMLP)
               for layer in model.model.layers)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(ids).logits.float(), twin(ids).logits.float()
    torch.testing.assert_close(got, want, rtol=2.0 ** -7, atol=2.0 ** -7 * want.abs().max().item())
    served = wrap_model(make_tiny_gemma3(len(make_test_tokenizer())).to(torch.bfloat16), make_test_tokenizer(),
                        name="tiny-gemma3", pack_weights=True, fuse_layers=True).model
    assert all(isinstance(layer.self_attn, FusedGemmaAttention) for layer in served.model.layers)


def test_cached_prefill_and_exact_module_reuse_equal_the_hf_forward():
    """Each prompt's first-token logits in `exact` mode, modules from the store where a full prefill computes them
    identically, the rest prefilled over them: HF's forward of the whole prompt agrees."""
    runtime, oracle = _served()
    assert_exact_prefill_equals_hf(runtime, oracle, PROMPTS, EXACT)


def test_batched_decode_and_greedy_generation_equal_the_hf_forward():
    """All prompts at once (`exact`): steps decode several sequences together over shared module KV; every greedy
    token equals HF's own generation loop and its logprob HF's forward over prompt + answer."""
    runtime, oracle = _served()
    assert_batched_generation_equals_hf(runtime, oracle, PROMPTS, num_tokens=NUM_TOKENS, fidelity=EXACT)


def test_key_shifter_rotates_each_layer_with_its_layer_types_base():
    """Keys RoPE-rotated by HF at p, per layer with its type's table, and shifted by s equal HF's keys at p + s; the
    local and global bases differ, so one table for all layers would not."""
    model = make_tiny_gemma3(64)
    shifter = KeyShifter.of(model, HEAD_DIM)
    assert shifter is not None and tuple(shifter.inv_freq.shape) == (len(LAYER_TYPES), HEAD_DIM // 2)
    assert not torch.equal(shifter.inv_freq[0], shifter.inv_freq[2]) and torch.equal(*shifter.inv_freq[:2])
    generator = torch.Generator().manual_seed(0)
    raw = torch.randn(len(LAYER_TYPES), 2, 40, HEAD_DIM, generator=generator)  # [L, H_kv, n, D] before RoPE
    stored = torch.arange(500, 540)
    shift = torch.tensor([-480] * 20 + [7] * 20)                                # two segments moved apart

    def rope(positions: torch.Tensor) -> torch.Tensor:  # [L, H_kv, n, D]: each layer with its type's cos/sin
        rotary = model.base_model.rotary_emb
        return torch.stack([apply_rotary_pos_emb(raw[i:i + 1], raw[i:i + 1],
                                                 *rotary(raw, positions[None], kind))[1][0]
                            for i, kind in enumerate(LAYER_TYPES)])

    shifted = shifter.shifted(rope(stored), shift)
    assert (shifted - rope(stored + shift)).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match="keys of 2 layers"):
        shifter.shifted(rope(stored)[:2], shift)


def test_moved_module_kv_equals_the_hf_forward_of_what_it_reuses():
    """`fast` reuse at contiguous positions shifts each module's keys (per layer base) to where the prompt puts them:
    equal to HF's forward of the same tokens at those positions under the reuse mask."""
    runtime, oracle = _served()
    moved = Fidelity("fast", positions="contiguous")
    for prompt in PROMPTS:
        plan = runtime.plan(prompt)
        logits, _ = first_step(runtime, plan, moved)
        tokens, positions, mask = reuse_reference(plan, resolve(plan, moved))
        assert (logits - full_prefill_logits(oracle, tokens, positions, mask)[-1]).abs().max().item() <= 1e-4, prompt


def test_what_is_not_implemented_is_refused_naming_it():
    vocab = 64
    for setting, value, what in (("attn_logit_softcapping", 50.0, "attention logit soft-capping"),
                                 ("final_logit_softcapping", 30.0, "final logit soft-capping"),
                                 ("use_bidirectional_attention", True, "bidirectional attention")):
        with pytest.raises(UnsupportedModelError, match=f"gemma3_text model with {what}"):
            check_architecture(tiny_gemma3_config(vocab, **{setting: value}))
    dynamic = {kind: {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10_000.0} for kind in set(LAYER_TYPES)}
    with pytest.raises(UnsupportedModelError, match="dynamic RoPE scaling"):
        check_architecture(tiny_gemma3_config(vocab, rope_parameters=dynamic))
    with pytest.raises(UnsupportedModelError, match=r"'gemma2'.*soft-capping.*supported: gemma3_text, gpt2"):
        check_architecture(Gemma2Config(vocab_size=vocab))
    with pytest.raises(UnsupportedModelError, match=r"'gemma3'.*multimodal.*text-only"):
        check_architecture(Gemma3Config())
    tokenizer = make_test_tokenizer()
    with pytest.raises(ModelLoadError, match=r"deterministic serving.*not 'gemma3_text'"):
        wrap_model(make_tiny_gemma3(len(tokenizer)), tokenizer, name="tiny-gemma3", deterministic=True)

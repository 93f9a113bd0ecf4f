"""Qwen3 (per-head q/k RMSNorm before RoPE) and Phi-3 (joined qkv and gate|up projections) through the engine, against
Hugging Face's own forward of an untouched twin of the same random weights: cached prefill and `exact` module reuse
(first-token logits), batched decode and greedy generation (every token and its logprob), with the HF modules, the
fused layers (torch's ops, what a GPU runs; in bf16 the CPU kernels run the same layout) and deterministic serving's
layers; the static step over fused layers against the runner. Partial-rotary Phi-3 is served by its HF modules.
Architectures and RoPE variants still refused are refused at the config, naming what and why (Gemma 3 is tested in
test_gemma3.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3Config, LlamaConfig, Phi3Config

from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, UnsupportedModelError, avx2, wrap_model
from promptcache.model_runtime.baseline import full_prefill_logits
from promptcache.model_runtime.engine import Fidelity, resolve
from promptcache.model_runtime.loading import torch_layer_ops
from promptcache.model_runtime.loading.architectures import check_architecture
from promptcache.model_runtime.loading.fused_layers import FusedAttention, fuse_layers
from tests.model_factories import make_test_tokenizer, make_tiny_model, tiny_config
from tests.model_runtime.batched_generation import assert_batched_generation_equals_hf, assert_exact_prefill_equals_hf
from tests.model_runtime.engine_probe import first_step
from tests.model_runtime.oracles import reuse_reference
from tests.model_runtime.test_fidelity import PROMPTS, SCHEMA
from tests.model_runtime.test_static_step import _both, _sequences

ARCHS = ["qwen3", "phi3"]
LAYERS = ["hf", "fused", "avx2", "deterministic"]
EXACT = Fidelity("exact")
NUM_TOKENS = 10


def _served(arch: str, layers: str, model: torch.nn.Module | None = None,
            request: pytest.FixtureRequest | None = None) -> tuple[ModelRuntime, torch.nn.Module]:
    """(a runtime over the tiny `arch` model with schema `lib` and `layers`, an untouched HF twin of its weights: the
    oracle). Deterministic layers need the batch-invariant kernels, `avx2` the AVX2 fp32 ones (skipped where they cannot
    be built)."""
    if layers in ("deterministic", "avx2"):
        assert request is not None
        request.getfixturevalue("deterministic_kernels" if layers == "deterministic" else "avx2_kernels")
    tokenizer = make_test_tokenizer()
    served = model if model is not None else make_tiny_model(arch, vocab_size=len(tokenizer))
    oracle = AutoModelForCausalLM.from_config(served.config, attn_implementation="sdpa").eval()
    oracle.load_state_dict(served.state_dict())
    if layers in ("fused", "avx2"):
        ops = torch_layer_ops if layers == "fused" else avx2.fused_ops()
        assert fuse_layers(served, ops) == 4 * served.config.num_hidden_layers + 1
    loaded = wrap_model(served, tokenizer, name=f"tiny-{arch}-{layers}", deterministic=layers == "deterministic")
    assert isinstance(served.model.layers[0].self_attn, FusedAttention) == (layers != "hf")
    runtime = ModelRuntime(loaded, build_store(StoreConfig()))
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    return runtime, oracle


@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_cached_prefill_and_exact_module_reuse_equal_the_hf_forward(request, arch, layers):
    """Each prompt's first-token logits in `exact` mode: the modules a full prefill would compute identically come from
    the store (one prompt reuses d0), the rest is prefilled over them; HF's forward of the whole prompt agrees."""
    runtime, oracle = _served(arch, layers, request=request)
    assert_exact_prefill_equals_hf(runtime, oracle, PROMPTS, EXACT)


@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_decode_and_greedy_generation_equal_the_hf_forward(request, arch, layers):
    """All prompts at once through one engine (`exact`): steps decode several sequences together over shared module
    KV; every greedy token equals HF's own generation loop and its logprob HF's forward over prompt + answer."""
    runtime, oracle = _served(arch, layers, request=request)
    assert_batched_generation_equals_hf(runtime, oracle, PROMPTS, num_tokens=NUM_TOKENS, fidelity=EXACT)


@pytest.mark.parametrize("arch", ARCHS)
def test_static_step_over_fused_layers_equals_the_runner(arch):
    """The graph-capturable step (q/k norm inside it for Qwen3) decodes 3 sequences padded to 4 as the runner does."""
    tokenizer = make_test_tokenizer()
    model = make_tiny_model(arch, vocab_size=len(tokenizer))
    assert fuse_layers(model, torch_layer_ops) > 0
    loaded = wrap_model(model, tokenizer, name=f"tiny-{arch}-static")
    seqs = _sequences(loaded, 3)
    expected, got, *_ = _both(loaded, seqs, 4)
    torch.testing.assert_close(got.logits[:3], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.greedy_ids[:3], expected.argmax(-1))


def test_partial_rotary_phi3_is_served_by_its_hf_modules():
    """RoPE over half of each head (Phi-4-mini rotates 3/4): the fused layers leave it alone, the HF modules serve it
    (`exact` equals HF's forward) and module KV moved to contiguous positions rotates only the rotated dimensions
    (`fast` equals HF's forward of what it reuses, the explicit-mask oracle)."""
    tokenizer = make_test_tokenizer()
    config = tiny_config("phi3", vocab_size=len(tokenizer))
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.5}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert fuse_layers(model, torch_layer_ops) == 0
    runtime, oracle = _served("phi3", "hf", model)
    shifter = runtime.loaded.key_shifter
    assert shifter is not None and 2 * shifter.inv_freq.numel() == runtime.loaded.head_dim // 2
    moved = Fidelity("fast", positions="contiguous")
    for prompt in PROMPTS:
        plan = runtime.plan(prompt)
        logits, _ = first_step(runtime, plan, EXACT)
        reference = full_prefill_logits(oracle, plan.token_ids(), range(plan.num_prompt_tokens))[-1]
        assert (logits - reference).abs().max().item() <= 1e-4, prompt
        logits, _ = first_step(runtime, plan, moved)
        tokens, positions, mask = reuse_reference(plan, resolve(plan, moved))
        assert (logits - full_prefill_logits(oracle, tokens, positions, mask)[-1]).abs().max().item() <= 1e-4, prompt


def test_unserved_models_are_refused_naming_what_and_why():
    common = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048)
    with pytest.raises(UnsupportedModelError, match=r"'gemma3'.*multimodal.*supported: gemma3_text, gpt2, llama"):
        check_architecture(Gemma3Config())
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 1024}
    phi3 = Phi3Config(**common, pad_token_id=None, rope_parameters=longrope)
    with pytest.raises(UnsupportedModelError, match=r"phi3 .*longrope RoPE scaling.*length"):
        check_architecture(phi3)
    with pytest.raises(UnsupportedModelError, match=r"phi3 .*attn_logit_softcapping"):
        check_architecture(Phi3Config(**common, pad_token_id=None, sliding_window=2047, attn_logit_softcapping=30.0))
    dynamic = LlamaConfig(**common, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError, match="dynamic RoPE scaling"):
        check_architecture(dynamic)
    assert check_architecture(tiny_config("qwen3", vocab_size=64)).qk_norm
    assert check_architecture(tiny_config("phi3", vocab_size=64)).qkv == ("qkv_proj",)

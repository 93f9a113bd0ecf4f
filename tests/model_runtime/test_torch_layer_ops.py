"""The fused decoder layers with PyTorch's ops (loading/torch_layer_ops.py, what a GPU runs) against the
Hugging Face modules: RoPE bit for bit, RMSNorm and the gated MLP within rounding, whole models and the
engine's tokens. On the CPU the ops are chosen by hand; with PROMPTCACHE_TEST_DEVICE=cuda `fuse_layers`
chooses them itself."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, SamplingParams, wrap_model
from promptcache.model_runtime.loading import fused_layers, torch_layer_ops
from promptcache.model_runtime.loading.architectures import ARCHITECTURES
from promptcache.model_runtime.loading.fused_layers import FusedAttention, FusedGatedMLP, FusedRMSNorm
from tests.conftest import TEST_DEVICE
from tests.model_factories import make_test_tokenizer, tiny_config
from tests.model_runtime.engine_probe import engine_tokens

LLAMA = ARCHITECTURES["llama"]


@pytest.fixture
def torch_ops_here(monkeypatch):
    """`fuse_layers` picks the torch ops on the test device (on a GPU it does so by itself)."""
    if TEST_DEVICE == "cpu":
        monkeypatch.setattr(fused_layers, "_layer_ops", lambda parameter: torch_layer_ops)


def assert_rope_matches_hf(rope_qk, heads: int, kv_heads: int, dim: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """`rope_qk` (the torch ops', the bf16 or the fp32 kernels') equals `apply_rotary_pos_emb` bit for bit."""
    generator = torch.Generator().manual_seed(dim + heads)
    rows = 133
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    angles = torch.arange(rows)[:, None] * torch.rand(dim // 2, generator=generator)[None] * 3  # [rows, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    q = qkv[:, : heads * dim].view(1, rows, heads, dim).transpose(1, 2)
    k = qkv[:, heads * dim: (heads + kv_heads) * dim].view(1, rows, kv_heads, dim).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    got_q, got_k = rope_qk(qkv, cos, sin, heads, kv_heads)
    assert torch.equal(got_q.reshape(1, rows, heads, dim).transpose(1, 2), want_q)
    assert torch.equal(got_k.reshape(1, rows, kv_heads, dim).transpose(1, 2), want_k)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128)])
def test_rope_matches_apply_rotary_pos_emb_bit_for_bit(heads, kv_heads, dim):
    assert_rope_matches_hf(torch_layer_ops.rope_qk, heads, kv_heads, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_mlp_match_the_llama_modules(dtype):
    generator = torch.Generator().manual_seed(3)
    norm = LlamaRMSNorm(256, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(256, generator=generator))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        mlp = LlamaMLP(LlamaConfig(hidden_size=256, intermediate_size=352)).to(dtype)
    x = (torch.randn(2, 41, 256, generator=generator) * 3).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: one rounding step of the largest outputs
    with torch.inference_mode():
        for fused, plain in ((FusedRMSNorm(norm, torch_layer_ops), norm),
                             (FusedGatedMLP(copy.deepcopy(mlp), torch_layer_ops, LLAMA), mlp)):
            got, want = fused(x).float(), plain(x).float()
            assert got.dtype == want.dtype and ((got - want).abs().max() / want.abs().max()).item() <= tolerance


def _model(arch: str, vocab_size: int, dtype: torch.dtype) -> torch.nn.Module:
    """`arch` at the bf16 kernels' shapes (heads of 64, Qwen3's of 128) and GQA, random weights drawn in fp32, on the
    test device."""
    config = tiny_config(arch, vocab_size=vocab_size, hidden_size=256)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.to(dtype).to(TEST_DEVICE).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_fused_model_matches_the_hf_model(torch_ops_here, arch):
    """fp32 forward passes (prefill, then a decode step over the cache): every module swapped, the same logits."""
    plain = _model(arch, 512, torch.float32)
    fused = copy.deepcopy(plain)
    assert fused_layers.fuse_layers(fused) == 2 * 4 + 1  # per layer two norms, attention, MLP; the final norm
    assert isinstance(fused.model.layers[0].self_attn, FusedAttention)
    ids = torch.randint(0, 512, (2, 37), generator=torch.Generator().manual_seed(1)).to(TEST_DEVICE)
    with torch.inference_mode():
        want, got = plain(ids, use_cache=True), fused(ids, use_cache=True)
        assert (got.logits - want.logits).abs().max().item() <= 1e-4
        step = ids[:, -1:]
        got_next = fused(step, cache=got.past_key_values).logits
        assert (got_next - plain(step, cache=want.past_key_values).logits).abs().max().item() <= 1e-4


DOC = " ".join(f"The river {i} flows north through the valley of stone." for i in range(12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_with_torch_fused_layers_generates_the_unfused_tokens(torch_ops_here, dtype):
    """The engine (module reuse, prefill, decode through the plain layer loop) with the torch-op layers
    against the Hugging Face modules: the same greedy tokens."""
    tokenizer = make_test_tokenizer()
    tokens = []
    for fuse in (False, True):
        loaded = wrap_model(_model("llama", len(tokenizer), dtype), tokenizer, name="d64", fuse_layers=fuse)
        assert isinstance(loaded.model.model.layers[0].mlp, FusedGatedMLP) == fuse
        runtime = ModelRuntime(loaded, build_store(StoreConfig(), device=TEST_DEVICE))
        runtime.add_schema(runtime.parse_schema(f'<schema name="s"><module name="doc">{DOC}</module></schema>'))
        plan = runtime.plan('<prompt schema="s"><doc/>Where does the river flow?</prompt>')
        tokens.append(engine_tokens(runtime, plan, SamplingParams(max_tokens=10, temperature=0)))
    assert tokens[0] == tokens[1] and len(tokens[0]) == 10

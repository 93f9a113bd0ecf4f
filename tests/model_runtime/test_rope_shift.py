"""KeyShifter against transformers' own rotary embedding: a key RoPE-rotated at position p and shifted by s
equals the key RoPE-rotated at p + s."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaForCausalLM, apply_rotary_pos_emb

from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.rope_shift import KeyShifter
from tests.model_factories import make_tiny_model

HEAD_DIM = 16  # the tiny models': hidden 64 over 4 heads


def _rope(model, raw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """HF's RoPE of `raw` [1, H, n, D] at `positions` [n]."""
    cos, sin = model.base_model.rotary_emb(raw, positions[None])  # [1, n, D]
    rotated, _ = apply_rotary_pos_emb(raw, raw, cos, sin)
    return rotated


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shifted_keys_equal_rope_at_the_new_positions(arch, dtype):
    model = make_tiny_model(arch, vocab_size=64)
    shifter = KeyShifter.of(model, HEAD_DIM)
    assert shifter is not None
    generator = torch.Generator().manual_seed(0)
    raw = torch.randn(1, 2, 40, HEAD_DIM, generator=generator)              # [1, H, n, D] before RoPE
    stored = torch.arange(500, 540)                                          # layout positions
    shift = torch.tensor([-480] * 20 + [7] * 20)                             # two segments moved apart
    expected = _rope(model, raw, stored + shift)
    shifted = shifter.shifted(_rope(model, raw, stored).to(dtype), shift)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2  # bf16: the stored key's own rounding, ~3 ulps
    assert shifted.dtype == dtype
    assert (shifted.float() - expected).abs().max().item() <= tolerance
    # Shifts compose, and a zero shift is the identity.
    back = shifter.shifted(shifter.shifted(expected, -shift), torch.zeros(40, dtype=torch.long))
    assert (back - _rope(model, raw, stored)).abs().max().item() <= 1e-4


def test_shift_into_writes_a_view_of_a_larger_buffer():
    model = make_tiny_model("llama", vocab_size=64)
    shifter = KeyShifter.of(model, HEAD_DIM)
    keys = torch.randn(2, 2, 5, HEAD_DIM)                                    # [L, H, n, D]
    buffer = torch.zeros(2, 2, 9, HEAD_DIM)
    shifter.shift_into(buffer[:, :, 3:8], keys, torch.full((5,), 4))
    assert torch.equal(buffer[:, :, :3], torch.zeros(2, 2, 3, HEAD_DIM))
    assert torch.allclose(buffer[:, :, 3:8], shifter.shifted(keys, torch.full((5,), 4)))


def test_models_without_static_rope_have_no_shifter():
    assert KeyShifter.of(make_tiny_model("gpt2", vocab_size=64), HEAD_DIM) is None  # learned positions
    dynamic = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2,
                          rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert KeyShifter.of(LlamaForCausalLM(dynamic), HEAD_DIM) is None  # frequencies change with the length


@pytest.mark.skipif(not bf16_kernel.supported(), reason="this CPU lacks AVX512-BF16")
@pytest.mark.parametrize("rotated_dims", [64, 32])  # full and partial rotary
def test_the_bf16_kernel_shifts_keys_bit_for_bit_as_the_torch_ops(bf16_kernels, monkeypatch, rotated_dims):
    """In bf16 with the kernels loaded, shift_into runs one fused pass; it writes exactly what the torch ops
    write, into a view of a larger buffer, and nothing outside it."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotated_dims, 2).float() / rotated_dims))
    shifter = KeyShifter(inv_freq, 64)
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(3, 2, 45, 64, generator=generator).bfloat16()      # [L, H, n, D]
    shift = torch.tensor([-700] * 20 + [33] * 25)
    calls = []
    ops = bf16_kernel.fused_ops()
    counted = dataclasses.replace(ops, shift_keys=lambda *args: calls.append(1) or ops.shift_keys(*args))
    monkeypatch.setitem(bf16_kernel._state, "ops", counted)
    buffer = torch.zeros(3, 2, 60, 64, dtype=torch.bfloat16)
    shifter.shift_into(buffer[:, :, 10:55], keys, shift)
    assert calls == [1]
    monkeypatch.setitem(bf16_kernel._state, "ops", None)  # the torch ops
    assert torch.equal(buffer[:, :, 10:55], shifter.shifted(keys, shift))
    assert not buffer[:, :, :10].any() and not buffer[:, :, 55:].any()

"""The bf16 kernels' product with a GGUF's 8-bit blocks (attention/csrc/int8_bf16.cpp) and Int8BlockLinear in bf16.

Oracles: a float64 matmul of the blocks' dequantized weight (the kernel's products are exact and its sums fp32, so its
only visible rounding is the bf16 output: held to about one bf16 step); gguf's own quantize and dequantize of a Q8_0
and a Q6_K tensor; PyTorch's fp32 product rounded to bf16 for the dequantized copy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.loading.gguf_blocks import q6_k_blocks, q8_0_blocks
from promptcache.model_runtime.loading.stored_linear import INT8_BF16_BLOCK_ROWS, Int8BlockLinear, Int8Blocks
from tests.model_runtime.test_gguf_blocks import wide_raw

pytestmark = pytest.mark.skipif(not bf16_kernel.supported(), reason="this CPU lacks AVX512-BF16")

BF16_ROUNDING = 2.0 ** -8  # rounding to bf16 (8 significant bits) moves a value by at most 2^-8 of it


def _close_to_bf16_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """`got` (bf16) is `want` rounded to bf16, up to fp32 accumulation order (a sliver of the largest output)."""
    bound = want.abs() * BF16_ROUNDING + 1e-5 * want.abs().max()
    return bool(((got.double() - want).abs() <= bound).all())


def _blocks(kind: GGMLQuantizationType, out_features: int, in_features: int, seed: int) -> tuple[Int8Blocks,
                                                                                                  torch.Tensor]:
    """A Q8_0 (fp16 scales per 32 inputs) or Q6_K (fp32 scales per 16) tensor's blocks and gguf's dequantize of it."""
    rng = np.random.default_rng(seed)
    if kind is GGMLQuantizationType.Q8_0:
        raw = quantize(rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.05, kind)
        blocks = q8_0_blocks(raw)
    else:
        raw = wide_raw(rng, kind, out_features, in_features)
        blocks = q6_k_blocks(raw)
    return blocks, torch.from_numpy(dequantize(raw, kind).copy())


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q6_K])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 8, 9, 17])
def test_int8_product_equals_ggufs_dequantized_weight(bf16_kernels, kind, num_rows):
    """Rows in passes of up to 8, 48 outputs (three blocks of 16: a pass of two and one alone), groups of 32 inputs
    with fp16 scales (Q8_0) and of 16 with fp32 ones (Q6_K: d * sc)."""
    blocks, want_weight = _blocks(kind, 48, 512, seed=num_rows)
    assert torch.equal(blocks.dequantized(), want_weight)
    layer = Int8BlockLinear(blocks, None, torch.bfloat16)
    fp16 = kind is GGMLQuantizationType.Q8_0
    assert layer.block_scales.dtype == (torch.float16 if fp16 else torch.float32)
    assert torch.equal(layer.blocks().values, blocks.values) and torch.equal(layer.blocks().scales, blocks.scales)
    x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(num_rows)).bfloat16()
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (num_rows, 48)
    assert _close_to_bf16_rounding(got, x.double() @ want_weight.double().T)


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q6_K])
def test_many_rows_multiply_the_dequantized_copy(bf16_kernels, kind):
    """From INT8_BF16_BLOCK_ROWS rows the layer multiplies its dequantized bf16 copy, each weight `scale * q` rounded
    once to bf16 (what a bf16 load of the widened file holds), through PyTorch's matmul; the bias added after."""
    blocks, want_weight = _blocks(kind, 32, 256, seed=7)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(1))
    layer = Int8BlockLinear(blocks, bias, torch.bfloat16)
    copy = layer.dequantized()
    assert copy.dtype == torch.bfloat16 and torch.equal(copy, want_weight.bfloat16())
    x = torch.randn(INT8_BF16_BLOCK_ROWS, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert torch.equal(layer(x), torch.nn.functional.linear(x, want_weight.bfloat16(), bias.bfloat16()))
    few = x[:3]  # the kernel: the product rounded to bf16, then the bias added in bf16 (a second rounding)
    product = few.double() @ want_weight.double().T
    want = product + bias.bfloat16().double()
    bound = (want.abs() + product.abs()) * BF16_ROUNDING + 1e-5 * want.abs().max()
    assert bool(((layer(few).double() - want).abs() <= bound).all())

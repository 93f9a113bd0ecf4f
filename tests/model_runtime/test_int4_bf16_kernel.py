"""The extension's int4 product for few rows (attention/csrc/int4_bf16.cpp) and Int4Linear's use of it.

Oracles: a float32 matmul of the blocks' dequantized weight (the kernel's only rounding is its bf16
output, so it is held to about one bf16 step); a Q4_1 file written and dequantized by the `gguf` package;
PyTorch's own int4 kernel on the same blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from promptcache.model_runtime import avx2
from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.loading.gguf_weights import read_layers, read_q8_0_head
from promptcache.model_runtime.loading.quantized_linear import (
    GROUP_SIZE,
    HEAD,
    INT4_KERNEL_ROWS,
    Int4Blocks,
    Int4Linear,
)
from promptcache.model_runtime.loading.stored_linear import SplitByteLinear

pytestmark = pytest.mark.skipif(not bf16_kernel.supported(), reason="this CPU lacks AVX512-BF16")

BF16_ROUNDING = 2.0 ** -8  # rounding to bf16 (8 significant bits) moves a value by at most 2^-8 of it
SMOLLM2_SHAPES = [(576, 960), (1536, 576), (576, 3072)]  # (in, out): q|k|v, down, gate|up


def _close_to_bf16_rounding(got: torch.Tensor, want: torch.Tensor, product: torch.Tensor | None = None) -> bool:
    """`got` (bf16) is `want` rounded to bf16, up to fp32 accumulation order (a sliver); with `product`,
    `want` is the product plus a bias added after rounding the product (two roundings)."""
    bound = want.abs() * BF16_ROUNDING + 1e-5 * want.abs().max()
    if product is not None:
        bound += product.abs() * BF16_ROUNDING
    return bool(((got.float() - want).abs() <= bound).all())


def _ops() -> bf16_kernel.Int4Ops:
    ops = bf16_kernel.int4_ops()
    assert ops is not None
    return ops


@pytest.mark.parametrize("num_rows", [1, 3, 4, 7, 16])
@pytest.mark.parametrize(("in_features", "out_features"), SMOLLM2_SHAPES)
def test_int4_mm_is_the_float_matmul_of_the_blocks(bf16_kernels, in_features, out_features, num_rows):
    generator = torch.Generator().manual_seed(num_rows)
    blocks = Int4Blocks.of(torch.randn(out_features, in_features, generator=generator) * 0.1, torch.bfloat16)
    x = torch.randn(num_rows, in_features, generator=generator).bfloat16()
    got = _ops().mm(x, *_ops().pack(blocks.values, blocks.scales, blocks.minimums))
    assert got.shape == (num_rows, out_features) and got.dtype == torch.bfloat16
    assert _close_to_bf16_rounding(got, x.float() @ blocks.dequantized().T)


def test_int4_mm_takes_any_scales_and_minimums_and_strided_rows(bf16_kernels):
    """Minimums that are not `zero - 8 * scale` of a bf16 zero (GGUF's fp16 ones, of either sign), more
    rows than one register pass (8), and x as a column slice of a wider tensor."""
    generator = torch.Generator().manual_seed(1)
    out_features, in_features = 48, 4 * GROUP_SIZE
    values = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    scales = torch.rand(out_features, in_features // GROUP_SIZE, generator=generator).half().float() * 0.05
    minimums = torch.randn(out_features, in_features // GROUP_SIZE, generator=generator).half().float() * 0.3
    blocks = Int4Blocks(values, scales, minimums)
    x = torch.randn(19, 2 * in_features, generator=generator).bfloat16()[:, 16:16 + in_features]
    got = _ops().mm(x, *_ops().pack(values, scales, minimums))
    assert _close_to_bf16_rounding(got, x.float() @ blocks.dequantized().T)


def test_int4_pack_holds_fp16_scales_only_where_exact(bf16_kernels):
    """One scale or minimum that fp16 cannot hold keeps the layer's in fp32, and both holdings give the
    same product (the epilogue's arithmetic is fp32 either way)."""
    generator = torch.Generator().manual_seed(3)
    out_features, in_features = 32, 2 * GROUP_SIZE
    values = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    scales = (torch.rand(out_features, 2, generator=generator) * 0.05).half().float()
    minimums = (torch.randn(out_features, 2, generator=generator) * 0.3).half().float()
    x = torch.randn(3, in_features, generator=generator).bfloat16()
    as_fp16 = _ops().pack(values, scales, minimums)
    inexact = minimums.clone()
    inexact[5, 1] += 2.0 ** -20 * inexact[5, 1].abs()  # between two fp16 values
    as_fp32 = _ops().pack(values, scales, inexact)
    assert as_fp16[1].dtype == torch.float16 and as_fp32[1].dtype == as_fp32[2].dtype == torch.float32
    got_fp32 = _ops().mm(x, *as_fp32)
    assert _close_to_bf16_rounding(got_fp32, x.float() @ Int4Blocks(values, scales, inexact).dequantized().T)
    exact_in_fp32 = _ops().pack(values, scales, minimums)[0], *(t.float() for t in as_fp16[1:])
    assert torch.equal(_ops().mm(x, *as_fp16), _ops().mm(x, *exact_in_fp32))


def test_int4_mm_multiplies_gguf_q4_1_blocks(bf16_kernels, tmp_path):
    """Blocks as a Q4_1 file stores them (read_layers) multiply by the weight gguf's dequantize gives."""
    weight = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32) * 0.02
    writer = GGUFWriter(tmp_path / "m.gguf", "llama")
    stored = quantize(weight, GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.ffn_down.weight", stored, raw_shape=stored.shape, raw_dtype=GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    blocks = read_layers(tmp_path / "m.gguf", 4, 2).blocks["model.layers.0.mlp.down_proj"]
    want_weight = torch.from_numpy(dequantize(stored, GGMLQuantizationType.Q4_1).copy())
    x = torch.randn(5, 256).bfloat16()
    packed = _ops().pack(blocks.values, blocks.scales, blocks.minimums)
    assert packed[1].dtype == packed[2].dtype == torch.float16  # Q4_1's own fp16 d and m, as stored
    got = _ops().mm(x, *packed)
    assert _close_to_bf16_rounding(got, x.float() @ want_weight.T)


def _write_gguf(path, name: str, weight: np.ndarray, kind) -> np.ndarray:
    writer = GGUFWriter(path, "llama")
    stored = quantize(weight, kind)
    writer.add_tensor(name, stored, raw_shape=stored.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


@pytest.mark.parametrize("num_rows", [1, 5, 12])
def test_a_q8_0_head_multiplies_as_the_file_stores_it(bf16_kernels, tmp_path, num_rows):
    """The tied embedding's Q8_0 blocks, split into two 4-bit planes, multiply by the weight gguf's
    dequantize gives (one product, one rounding), held in fp16 scales."""
    weight = np.random.default_rng(1).standard_normal((96, 128)).astype(np.float32) * 0.05
    stored = _write_gguf(tmp_path / "m.gguf", "token_embd.weight", weight, GGMLQuantizationType.Q8_0)
    blocks = read_q8_0_head(tmp_path / "m.gguf")[HEAD]
    want_weight = torch.from_numpy(dequantize(stored, GGMLQuantizationType.Q8_0).copy())
    assert torch.equal(blocks.dequantized(), want_weight)
    planes = blocks.planes().dequantized()  # [96, 2 x 128]: high plane | low plane
    assert torch.equal(planes[:, :128] + planes[:, 128:], want_weight)
    head = SplitByteLinear(blocks, torch.bfloat16)
    assert head.planes.kernel_scales is not None and head.planes.kernel_scales.dtype == torch.float16
    x = torch.randn(num_rows, 128, generator=torch.Generator().manual_seed(num_rows)).bfloat16()
    got = head(x)
    assert got.shape == (num_rows, 96)
    assert _close_to_bf16_rounding(got, x.float() @ want_weight.T)


def test_a_head_stored_otherwise_is_not_read(tmp_path):
    weight = np.random.default_rng(2).standard_normal((64, 64)).astype(np.float32)
    _write_gguf(tmp_path / "m.gguf", "token_embd.weight", weight, GGMLQuantizationType.Q4_1)
    assert read_q8_0_head(tmp_path / "m.gguf") == {}


@pytest.mark.parametrize("num_rows", [1, 4, 33, 100])
def test_int4_linear_runs_the_kernel_in_bf16_and_agrees_with_torchs_int4_kernel(bf16_kernels, monkeypatch,
                                                                                 num_rows):
    generator = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(576, 960, dtype=torch.bfloat16).requires_grad_(False)
    linear.weight.copy_(torch.randn(960, 576, generator=generator) * 0.1)
    blocks = Int4Blocks.of(linear.weight, torch.bfloat16)
    layer = Int4Linear(blocks, linear.bias, torch.bfloat16)
    assert layer.kernel_values is not None and "kernel_values" not in layer.state_dict()
    x = torch.randn(2, num_rows, 576, generator=generator).bfloat16()
    calls: list[int] = []
    ops = _ops()
    def counted_mm(*args: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return ops.mm(*args)

    monkeypatch.setitem(bf16_kernel._state, "int4", bf16_kernel.Int4Ops(ops.pack, counted_mm))
    got = layer(x)
    assert calls == [1] and got.shape == (2, num_rows, 960)
    product = x.float() @ blocks.dequantized().T
    assert _close_to_bf16_rounding(got, product + linear.bias.float(), product)
    monkeypatch.setitem(bf16_kernel._state, "int4", None)  # PyTorch's int4 kernel on the same layer
    torchs = layer(x)
    assert calls == [1]
    # torch's kernel rounds s and z to bf16 and its sums differently: one or two bf16 steps apart
    assert torch.allclose(got.float(), torchs.float(), rtol=4 * BF16_ROUNDING, atol=2e-2)


def test_int4_linear_keeps_its_other_paths(bf16_kernels):
    """From INT4_KERNEL_ROWS[torch.bfloat16] rows a layer multiplies its dequantized copy, and fp32 layers never
    hold the bf16 packing: the AVX2 library's where it is loaded (this CPU has AVX2 too), else none."""
    blocks = Int4Blocks.of(torch.randn(64, 128) * 0.1, torch.bfloat16)
    layer = Int4Linear(blocks, None, torch.bfloat16)
    x = torch.randn(INT4_KERNEL_ROWS[torch.bfloat16], 128).bfloat16()
    assert torch.equal(layer(x), torch.matmul(x, layer.dequantized_t()))
    fp32 = Int4Linear(blocks, None, torch.float32)
    fp32_ops = avx2.int4_ops()
    if fp32_ops is None:
        assert fp32.kernel_values is None
    else:
        assert fp32.kernel_values is not None
        assert torch.equal(fp32.kernel_values, fp32_ops.pack(blocks.values, blocks.scales, blocks.minimums)[0])
        rows = torch.randn(3, 128)
        assert torch.allclose(fp32(rows), rows @ blocks.dequantized().float().T, rtol=1e-5, atol=1e-5)

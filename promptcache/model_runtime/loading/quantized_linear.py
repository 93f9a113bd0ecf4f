"""int8 / int4 weight-only CPU linear layers (PyTorch's kernels): `stored_linear.quantize_linears` puts them in,
`kernel_problem` says whether this machine runs them. int4 is GGUF's Q4_1 (`w = d * q + m` per GROUP_SIZE inputs: the
kernel's `(q - 8) * s + z` with s = d, z = m + 8 d), loaded as stored. From *_DEQUANTIZE_ROWS rows a dequantized copy
runs through oneDNN; below INT4_KERNEL_ROWS, our own int4 product where it is built: bf16 on AVX512-BF16
(attention/csrc/int4_bf16.cpp), fp32 on AVX2 (avx2/csrc/int4_f32.cpp)."""

from __future__ import annotations

import enum
import functools
import logging
from dataclasses import dataclass

import torch

from promptcache.model_runtime import avx2
from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.attention.bf16_kernel import Int4Ops

logger = logging.getLogger(__name__)

GROUP_SIZE = 32  # inputs per int4 group: GGUF's Q4_1 block
# From this many rows on, dequantizing and multiplying through oneDNN beats the kernel (SmolLM2's 3072 x 576,
# bf16, CPU time on one Zen 4 core: int8 kernel 0.82 vs 0.84 ms at 32 rows, 1.19 vs 0.99 at 48; int4 kernel
# 1.41 vs 1.62 ms at 64 rows, 2.14 vs 1.84 at 96; at 16 rows the kernels take 0.36-0.40 ms, bf16 0.15).
INT8_DEQUANTIZE_ROWS = 40
INT4_DEQUANTIZE_ROWS = 80
# Below this many rows the extension's int4 product beats the dequantized copy (bf16, 2 threads, Zen 4, ms a
# call, kernel vs dequantized: 576 -> 3072 at 160 rows 0.85 vs 0.98, at 400 rows 2.11 vs 1.87; 1536 -> 576
# 0.44 vs 0.53 and 1.10 vs 0.95; 576 -> 960 0.28 vs 0.35 and 0.69 vs 0.61).
# fp32 on AVX2 (2 threads, Zen 4, ms a call, kernel vs fp32 weights): 576 -> 3072 at 1 row 0.08 vs 0.31, 16 rows 0.79
# vs 1.39, 64 rows 2.2 vs 3.2; below the dequantized copy's rows it always runs (PyTorch's kernel has no AVX2 code).
INT4_KERNEL_ROWS = {torch.bfloat16: 256, torch.float32: INT4_DEQUANTIZE_ROWS}
HEAD = "lm_head"  # the output head's key in a mapping of stored blocks (gguf_weights.read_q8_0_head)
INT4_PACK_ROWS = 16  # the int4 packing needs output features in multiples of this
_INT4_OFFSET = 8  # the kernel's q - 8


def _unpacked_t(packed: torch.Tensor, in_features: int, block: int) -> torch.Tensor:
    """q^T [in, out / b, b] read from PyTorch's CPU int4 packing, if it holds per block of b output channels an
    [in, b / 2] byte array with channels 0..b/2-1 in the low nibbles and b/2..b-1 in the high ones."""
    blocks = packed.view(-1, in_features, block // 2)  # [out / b, in, b / 2]
    both = torch.cat([blocks & 0x0F, blocks >> 4], dim=2)  # [out / b, in, b]
    return both.permute(1, 0, 2)


@functools.cache
def _pack_block() -> int | None:
    """Output channels per block of this build's CPU int4 packing: it follows the kernel's vector width (PyTorch
    2.6-2.13: 64 where AVX-512 runs, 32 on AVX2), so it is read off a probe; None where neither layout matches
    (the layers then never dequantize and keep to the kernel)."""
    out_features, in_features = 128, 2 * GROUP_SIZE
    values = torch.randint(0, 16, (out_features, in_features), generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), 1)
    for block in (64, 32):
        if torch.equal(_unpacked_t(packed, in_features, block).reshape(in_features, -1).t(), values.to(torch.uint8)):
            return block
    return None


def int4_kernel(dtype: torch.dtype) -> Int4Ops | None:
    """Our int4 product for `dtype` activations where its library is loaded here: bf16 on AVX512-BF16 CPUs, fp32 on
    AVX2 ones; else None (PyTorch's kernel or the dequantized copy)."""
    if dtype == torch.bfloat16:
        return bf16_kernel.int4_ops() if bf16_kernel.prepare() else None
    return avx2.int4_ops() if dtype == torch.float32 else None


def int4_is_fast(dtype: torch.dtype) -> bool:
    """Whether a decode row's int4 product has vector code here for `dtype` activations (our kernel, or PyTorch's
    AVX-512 one): where it has not, 4-bit weights cost time instead of saving it."""
    return int4_kernel(dtype) is not None or int4_kernel_is_vectorized()


def int4_kernel_is_vectorized() -> bool:
    """Whether PyTorch's CPU int4 kernel runs its AVX-512 code here (the 64-channel packing). Elsewhere it runs
    element by element: on an AVX2 Zen 4 core, SmolLM2's 576 -> 3072 layer took 2.0 ms a decode row against fp32's
    0.38 ms, and 60 ms for 32 rows against 1.7 ms, so 4-bit weights there cost time instead of saving it."""
    return _pack_block() == 64


class WeightFormat(enum.Enum):
    """How a model's linear weights are held: as loaded (`native`), int8 per channel, or int4 per group; `auto`
    (asked for, never loaded): int4 for a GGUF stored in 4 bits where the kernel runs, else native
    (stored_weights.choose)."""

    AUTO = "auto"
    NATIVE = "native"
    INT8 = "int8"
    INT4 = "int4"


@dataclass(frozen=True, slots=True)
class Int4Blocks:
    """One linear layer's 4-bit weights: `w[n, k] = scales[n, g] * values[n, k] + minimums[n, g]` with
    g = k // GROUP_SIZE (Q4_1's form)."""

    values: torch.Tensor    # [out, in] uint8, 0..15
    scales: torch.Tensor    # [out, in // GROUP_SIZE] float32
    minimums: torch.Tensor  # [out, in // GROUP_SIZE] float32

    def __post_init__(self) -> None:
        out_features, in_features = self.values.shape
        assert in_features % GROUP_SIZE == 0, in_features
        assert self.scales.shape == self.minimums.shape == (out_features, in_features // GROUP_SIZE)

    @classmethod
    def of(cls, weight: torch.Tensor, dtype: torch.dtype) -> Int4Blocks:
        """Quantize a weight [out, in]: per group, scale (max - min) / 15 and minimum, as `dtype` holds them."""
        out_features, in_features = weight.shape
        groups = weight.detach().float().reshape(out_features, -1, GROUP_SIZE)  # [out, in / G, G]
        low, high = groups.amin(-1), groups.amax(-1)
        scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float16).tiny).to(dtype).float()
        zeros = (low + _INT4_OFFSET * scales).to(dtype).float()  # the kernel's z
        minimums = zeros - _INT4_OFFSET * scales
        values = torch.round((groups - minimums[..., None]) / scales[..., None]).clamp(0, 15)
        return cls(values.to(torch.uint8).reshape(out_features, in_features), scales, minimums)

    @classmethod
    def concatenated(cls, parts: list[Int4Blocks]) -> Int4Blocks:
        """The blocks of one layer whose output is `parts`' outputs side by side."""
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("values", "scales", "minimums")))

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] the blocks describe."""
        scales, minimums = (t.repeat_interleave(GROUP_SIZE, dim=1) for t in (self.scales, self.minimums))
        return scales * self.values.float() + minimums


class Int8Linear(torch.nn.Module):
    """`y = x @ (q * s)^T + b` with q int8 [out, in] and one symmetric scale per output channel."""

    weight_int8: torch.Tensor
    scales: torch.Tensor

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        dtype = linear.weight.dtype
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float16).tiny).to(dtype)  # [out]
        values = torch.round(weight / scales.float()[:, None]).clamp(-127, 127)  # against the scale as held
        self.register_buffer("weight_int8", values.to(torch.int8).contiguous())  # [out, in]
        self.register_buffer("scales", scales)
        self.bias = _bias(linear.bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [rows, in]
        if rows.shape[0] >= INT8_DEQUANTIZE_ROWS:
            weight = self.weight_int8.to(rows.dtype) * self.scales[:, None]  # [out, in]
            return torch.nn.functional.linear(x, weight, self.bias)
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)  # [rows, out]
        return _with_bias(y, self.bias).view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] this layer multiplies by."""
        return self.weight_int8.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4Linear(torch.nn.Module):
    """`y = x @ W^T + b` with W held as Int4Blocks in the CPU int4 kernel's packed layout, and where our int4 product
    runs for its dtype (`int4_kernel`) also in that kernel's layout (`kernel_values`, `kernel_scales`,
    `kernel_minimums`; else None)."""

    weight_int4: torch.Tensor
    scales_and_zeros: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor
    kernel_values: torch.Tensor | None
    kernel_scales: torch.Tensor | None
    kernel_minimums: torch.Tensor | None

    def __init__(self, blocks: Int4Blocks, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = blocks.values.shape
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.values.to(torch.int32), 1)
        self.register_buffer("weight_int4", packed)  # [out, in / 2] uint8, the kernel's layout
        # [in / G, out, 2]: per group and output channel (s, z), the kernel's qScaleAndZeros
        zeros = blocks.minimums + _INT4_OFFSET * blocks.scales
        self.register_buffer("scales_and_zeros", torch.stack([blocks.scales.t(), zeros.t()], -1).to(dtype).contiguous())
        # [in / G, out] each, contiguous: the dequantized copy's broadcast is 3.5x slower from strided scales
        self.register_buffer("scales", blocks.scales.t().to(dtype).contiguous())
        self.register_buffer("minimums", blocks.minimums.t().to(dtype).contiguous())
        self.bias = _bias(bias, dtype)
        # The dequantized copy reads the kernel's layout: only where it is the one known here.
        block = _pack_block()
        self.can_dequantize = (block is not None and self.out_features % block == 0
                               and torch.equal(self._values_t().reshape(self.in_features, -1).t(), blocks.values))
        self.dtype = dtype
        ops = int4_kernel(dtype)
        packed = ops.pack(blocks.values, blocks.scales, blocks.minimums) if ops is not None else [None] * 3
        for name, tensor in zip(("kernel_values", "kernel_scales", "kernel_minimums"), packed, strict=True):
            self.register_buffer(name, tensor, persistent=False)  # derived from the blocks: not in state_dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [rows, in]
        ops = int4_kernel(rows.dtype) if self.kernel_values is not None and rows.dtype == self.dtype else None
        if ops is not None and rows.shape[0] < INT4_KERNEL_ROWS[rows.dtype]:
            y = ops.mm(rows.contiguous(), self.kernel_values, self.kernel_scales, self.kernel_minimums)
        elif rows.shape[0] >= INT4_DEQUANTIZE_ROWS and self.can_dequantize:
            y = torch.matmul(rows, self.dequantized_t())
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight_int4, GROUP_SIZE, self.scales_and_zeros)
        return _with_bias(y, self.bias).view(*x.shape[:-1], self.out_features)  # [rows, out] -> [..., out]

    def dequantized_t(self) -> torch.Tensor:
        """W^T [in, out] in the activations' dtype: `scale * q + minimum` per group, rounded once."""
        block = _pack_block()
        assert block is not None and self.can_dequantize
        values = torch.empty(self.in_features, self.out_features // block, block,
                             dtype=self.minimums.dtype).copy_(self._values_t())  # [in, out / b, b]
        groups = values.view(-1, GROUP_SIZE, self.out_features)  # [in / G, G, out]
        torch.addcmul(self.minimums.unsqueeze(1), groups, self.scales.unsqueeze(1), out=groups)
        return values.view(self.in_features, self.out_features)

    def _values_t(self) -> torch.Tensor:
        """q^T as a view [in, out / b, b] uint8 of the CPU packing (b = _pack_block())."""
        return _unpacked_t(self.weight_int4, self.in_features, _pack_block() or self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@functools.cache
def kernel_problem(weights: WeightFormat, dtype: torch.dtype) -> str | None:
    """Why `weights` cannot run here for `dtype` activations (a missing op, a refusing CPU, wrong results
    on a probe), or None when it runs and agrees with a float matmul of the dequantized weight."""
    if weights is WeightFormat.NATIVE:
        return None
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(2 * GROUP_SIZE, 4 * INT4_PACK_ROWS, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(4 * INT4_PACK_ROWS, 2 * GROUP_SIZE, generator=generator))
    try:
        layer: torch.nn.Module
        if weights is WeightFormat.INT8:
            int8 = Int8Linear(linear)
            layer, weight = int8, int8.dequantized()
        else:
            blocks = Int4Blocks.of(linear.weight, dtype)
            layer, weight = Int4Linear(blocks, linear.bias, dtype), blocks.dequantized()
        # the kernel, the dequantized copy
        for num_rows in (3, max(INT8_DEQUANTIZE_ROWS, INT4_DEQUANTIZE_ROWS, *INT4_KERNEL_ROWS.values())):
            x = torch.randn(num_rows, 2 * GROUP_SIZE, generator=generator).to(dtype)  # [rows, in]
            with torch.no_grad():
                got = layer(x).float()
            expected = torch.nn.functional.linear(x.float(), weight, linear.bias.detach().float())
            if (got - expected).abs().max() > 0.02 * expected.abs().max():  # bf16: ~0.5 %; a bad layout: ~100 %
                return f"the {weights.value} layer disagrees with a float matmul on a probe of {num_rows} rows"
    except Exception as exc:  # an op missing from this torch build or refusing this CPU
        return f"{type(exc).__name__}: {exc}"
    return None


def fits_int4(linear: torch.nn.Linear) -> bool:
    """Whether the int4 kernel takes this layer's shape (inputs in whole groups, outputs in 16s)."""
    return linear.in_features % GROUP_SIZE == 0 and linear.out_features % INT4_PACK_ROWS == 0


def _bias(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.nn.Parameter | None:
    return None if bias is None else torch.nn.Parameter(bias.detach().to(dtype), requires_grad=False)


def _with_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias

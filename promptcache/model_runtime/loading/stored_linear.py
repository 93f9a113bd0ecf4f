"""Linear layers that multiply a checkpoint's stored blocks, and `quantize_linears`, which puts every quantized or
as-stored layer in a CPU model. A GGUF's 8-bit blocks (Q8_0, Q5_0's `d * (q - 16)`, Q6_K's sub-blocks) are Int8Blocks:
`Int8BlockLinear` multiplies their bytes in fp32 where the AVX2 library is loaded (an fp16 scale times an int8 is exact
in fp32: the widened layer's very weights, summed in another order) and in bf16 where the bf16 kernels are (the
integers exact in bf16, each group's fp32 sum times its scale: within a bf16 rounding of the widened layer);
elsewhere an 8-bit head runs as two 4-bit planes (`SplitByteLinear`). 4-bit blocks are quantized_linear's Int4Blocks
and Int4Linear."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from promptcache.model_runtime import avx2
from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.errors import ModelLoadError
from promptcache.model_runtime.loading.quantized_linear import (
    GROUP_SIZE,
    HEAD,
    INT4_DEQUANTIZE_ROWS,
    INT4_PACK_ROWS,
    Int4Blocks,
    Int4Linear,
    Int8Linear,
    WeightFormat,
    fits_int4,
)

logger = logging.getLogger(__name__)

INT8_BLOCK_ROWS = INT4_DEQUANTIZE_ROWS  # from here on a dequantized copy through oneDNN beats the fp32 int8 product
# bf16: the product converts each weight once per 8 rows and runs near oneDNN's speed (Gemma 3 270M's 72 layers, 2
# threads, Zen 4, one run: 10.5 ms at 16 rows, 183 at 256, 358 at 512, against 13.4, 149 and 273 for prepacked bf16
# weights, which the dequantized copy matches after its ~40 ms of dequantizing)
INT8_BF16_BLOCK_ROWS = 256
INT8_SUB_GROUP = 16  # Q6_K's inputs per scale (its super-block's sixteen sub-blocks)
_CHANNEL_BLOCKS = {torch.float32: 8, torch.bfloat16: 16}  # the int8 products' output channels per block


@dataclass(frozen=True, slots=True)
class Int8Blocks:
    """One linear layer's 8-bit weights: `w[n, k] = scales[n, g] * values[n, k]` with g = k // group, the group being
    GROUP_SIZE (Q8_0's form; Q5_0's) or INT8_SUB_GROUP (Q6_K's sub-blocks, values in -32..31)."""

    values: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out, in // group] float32

    def __post_init__(self) -> None:
        out_features, in_features = self.values.shape
        assert self.values.dtype == torch.int8, self.values.dtype
        assert self.scales.shape[0] == out_features and self.scales.shape[1] * self.group == in_features, (
            tuple(self.values.shape), tuple(self.scales.shape))

    @property
    def group(self) -> int:
        """Inputs per scale: GROUP_SIZE or INT8_SUB_GROUP."""
        in_features, num_groups = self.values.shape[1], self.scales.shape[1]
        group = in_features // max(num_groups, 1)
        assert group in (GROUP_SIZE, INT8_SUB_GROUP), f"{num_groups} scales for {in_features} inputs"
        return group

    @classmethod
    def concatenated(cls, parts: list[Int8Blocks]) -> Int8Blocks:
        """The blocks of one layer whose output is `parts`' outputs side by side (one group size)."""
        assert len({p.group for p in parts}) == 1, "parts of one layer share their group size"
        return cls(torch.cat([p.values for p in parts]), torch.cat([p.scales for p in parts]))

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] the blocks describe."""
        out_features, in_features = self.values.shape
        groups = self.values.view(out_features, -1, self.group).float() * self.scales[..., None]  # [out, in / g, g]
        return groups.view(out_features, in_features)

    def planes(self) -> Int4Blocks:
        """The weight as one int4 layer over the input written twice: q = 16 h + l - 128 (h, l: q + 128's nibbles)
        splits into groups of scale 16 d, minimum -128 d (high plane) and of scale d, minimum 0 (low plane)."""
        assert self.group == GROUP_SIZE, "int4 planes take groups of GROUP_SIZE inputs"
        biased = (self.values.to(torch.int16) + 128).to(torch.uint8)  # [out, in]
        d = self.scales
        return Int4Blocks(torch.cat([biased >> 4, biased & 0x0F], dim=1), torch.cat([16 * d, d], dim=1),
                          torch.cat([-128 * d, torch.zeros_like(d)], dim=1))


StoredBlocks = Int4Blocks | Int8Blocks  # a layer's weights as its checkpoint stores them


def int8_blocks_run_here(dtype: torch.dtype) -> bool:
    """Whether `Int8BlockLinear` runs for `dtype` activations here: fp32 with the AVX2 library loaded, bf16 with the
    bf16 kernels."""
    return _int8_ops(dtype) is not None


def _int8_ops(dtype: torch.dtype) -> avx2.Int8Ops | bf16_kernel.Int8Ops | None:
    if dtype == torch.float32:
        return avx2.int8_ops()
    if dtype == torch.bfloat16 and bf16_kernel.prepare():
        return bf16_kernel.int8_ops()
    return None


class Int8BlockLinear(torch.nn.Module):
    """`y = x @ W^T + b` for Int8Blocks in `dtype` (fp32 or bf16, `int8_blocks_run_here`): up to INT8_BLOCK_ROWS (fp32)
    or INT8_BF16_BLOCK_ROWS (bf16) rows the int8 product reads the packed bytes (`weight_int8`, `block_scales`: that
    library's layout), more rows multiply a dequantized copy."""

    weight_int8: torch.Tensor
    block_scales: torch.Tensor

    def __init__(self, blocks: Int8Blocks, bias: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        ops = _int8_ops(dtype)
        if ops is None:
            raise ModelLoadError(f"8-bit blocks are multiplied in fp32 by the AVX2 library or in bf16 by the bf16 "
                                 f"kernels, neither of which serves {dtype} here")
        self.out_features, self.in_features = blocks.values.shape
        self.dtype, channel_block = dtype, _CHANNEL_BLOCKS[dtype]
        if self.out_features % channel_block:
            raise ModelLoadError(f"the int8 product needs outputs in multiples of {channel_block}, "
                                 f"not {self.out_features}")
        self.max_rows = INT8_BLOCK_ROWS if dtype == torch.float32 else INT8_BF16_BLOCK_ROWS
        packed, scales = ops.pack(blocks.values.contiguous(), blocks.scales.float().contiguous())
        self.register_buffer("weight_int8", packed)    # fp32: [out / 8, in / 8, 64]; bf16: [out / 16, in / 2, 32]
        self.register_buffer("block_scales", scales)   # [out / b, in / G, b] fp16 where exact, else fp32
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.dtype)  # [rows, in]
        ops = _int8_ops(self.dtype)
        if ops is not None and rows.shape[0] < self.max_rows:
            y = ops.mm(rows.contiguous(), self.weight_int8, self.block_scales)  # [rows, out]
            y = y if self.bias is None else y + self.bias
        else:
            y = torch.nn.functional.linear(rows, self.dequantized(), self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in the layer's dtype: the blocks' (bf16: each `scale * q` rounded once)."""
        ops = _int8_ops(self.dtype)
        if isinstance(ops, bf16_kernel.Int8Ops):
            return ops.dequantize(self.weight_int8, self.block_scales)
        return self.blocks().dequantized().to(self.dtype)

    def blocks(self) -> Int8Blocks:
        """The Int8Blocks back from the packed layout. fp32's: byte 8n + j of an octet is channel j's input 8t + n;
        bf16's: byte 2j + e of a pair is channel j's input 2t + e."""
        channel_blocks, steps, _ = self.weight_int8.shape
        if self.dtype == torch.float32:
            values = self.weight_int8.view(channel_blocks, steps, 8, 8).permute(0, 3, 1, 2)
        else:
            values = self.weight_int8.view(torch.int8).view(channel_blocks, steps, 16, 2).permute(0, 2, 1, 3)
        scales = self.block_scales.permute(0, 2, 1).reshape(self.out_features, -1).float()  # [out, in / G]
        return Int8Blocks(values.reshape(self.out_features, self.in_features), scales)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"dtype={self.dtype}")


class SplitByteLinear(torch.nn.Module):
    """`y = x @ W^T` for an 8-bit head where no int8 product runs (int4 weights through PyTorch's int4 kernel alone, on
    an AVX-512 CPU without our libraries): its two 4-bit planes (`Int8Blocks.planes`) through the int4 layer,
    `[x, x] @ [W_high | W_low]^T`."""

    def __init__(self, blocks: Int8Blocks, dtype: torch.dtype) -> None:
        super().__init__()
        self.planes = Int4Linear(blocks.planes(), None, dtype)
        self.in_features, self.out_features = blocks.values.shape[1], blocks.values.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.planes(torch.cat([x, x], dim=-1))  # [..., 2 in] -> [..., out]


def head_layer(blocks: Int8Blocks, dtype: torch.dtype) -> torch.nn.Module | None:
    """The layer that serves an 8-bit head's blocks in `dtype`: the int8 product where it runs, else the planes; None
    (the head keeps its float weight) where neither takes its shape (a vocabulary not in 16s: GPT-2's 50,257)."""
    if blocks.values.shape[0] % INT4_PACK_ROWS:
        logger.info("the 8-bit head keeps its float weight: %d outputs are not in multiples of %d",
                    blocks.values.shape[0], INT4_PACK_ROWS)
        return None
    return Int8BlockLinear(blocks, None, dtype) if int8_blocks_run_here(dtype) else SplitByteLinear(blocks, dtype)


def quantize_linears(model: torch.nn.Module, weights: WeightFormat, blocks: Mapping[str, StoredBlocks] | None = None,
                     wider: Collection[str] = frozenset()) -> int:
    """Replace a CPU model's `nn.Linear` layers in place (after fusing, before packing); returns how many. A layer
    whose checkpoint modules all have `blocks` (HF module name -> as stored; HEAD: the output head's 8 bits) of one
    kind multiplies them, in any format but int8. Otherwise int8 quantizes every layer, int4 every layer that
    `fits_int4` and is not built from one the checkpoint stores in more bits (`wider`: not rounded again), native
    none."""
    assert weights is not WeightFormat.AUTO, "resolved before loading (stored_weights.choose)"
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    stored_blocks = blocks if blocks is not None and weights is not WeightFormat.INT8 else {}
    wider_sources = frozenset(wider)
    replaced = 0
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or child.weight.device.type != "cpu":
                continue
            dtype = child.weight.dtype
            names = _sources(parent, prefix, name)
            layer: torch.nn.Module | None
            if child is head:
                head_blocks = stored_blocks.get(HEAD)
                layer = None if not isinstance(head_blocks, Int8Blocks) else head_layer(head_blocks, dtype)
            elif (stored := _stored(stored_blocks, names, wider_sources)) is not None:
                layer = _stored_layer(stored, child, dtype)
            elif weights is WeightFormat.INT8:
                layer = Int8Linear(child)
            elif weights is WeightFormat.NATIVE:
                layer = None
            elif fits_int4(child) and not wider_sources.intersection(names):
                layer = Int4Linear(Int4Blocks.of(child.weight, dtype), child.bias, dtype)
            else:
                logger.info("%s.%s keeps its float weight: %s", prefix, name,
                            "the checkpoint stores it in more than 4 bits" if fits_int4(child) else
                            f"{child.out_features} x {child.in_features} is not an int4 kernel shape")
                layer = None
            if layer is not None:
                setattr(parent, name, layer)
                replaced += 1
    return replaced


def _stored_layer(stored: StoredBlocks, child: torch.nn.Linear, dtype: torch.dtype) -> torch.nn.Module | None:
    """The layer that multiplies a (non-head) layer's stored blocks in `dtype`; None (it keeps its float weight) for
    8-bit blocks whose outputs the int8 product's blocks do not divide. Raises ModelLoadError for 8-bit blocks where
    their product does not run (fp32 with the AVX2 library, bf16 with the bf16 kernels: stored_weights gives them
    only there)."""
    if isinstance(stored, Int8Blocks):
        if stored.values.shape[0] % _CHANNEL_BLOCKS.get(dtype, INT4_PACK_ROWS):
            logger.info("a layer of %d outputs keeps its float weight: the int8 product takes them in blocks of %d",
                        stored.values.shape[0], _CHANNEL_BLOCKS.get(dtype, INT4_PACK_ROWS))
            return None
        return Int8BlockLinear(stored, child.bias, dtype)
    return Int4Linear(stored, child.bias, dtype)


def _sources(parent: torch.nn.Module, prefix: str, name: str) -> list[str]:
    """The checkpoint's module names behind `parent.name` (a fused layer's joined projections, else itself)."""
    return [f"{prefix}.{source}".lstrip(".") for source in getattr(parent, "JOINED_PROJECTIONS", {}).get(name, (name,))]


def _stored(blocks: Mapping[str, StoredBlocks], names: list[str], wider: frozenset[str]) -> StoredBlocks | None:
    """The checkpoint's blocks of the layers `names` side by side; None when it stores none of them as blocks, or
    some in another kind of block or float (`wider`): that layer keeps its float weight. Some blocks and others
    missing without a reason would mix rounding schemes inside one layer: refused."""
    found = [blocks[n] for n in names if n in blocks]
    if not found:
        return None
    kinds = {(type(f), f.group if isinstance(f, Int8Blocks) else None) for f in found}
    if len(found) < len(names) or len(kinds) > 1:
        if wider.intersection(names) or len(found) == len(names):
            return None
        raise ModelLoadError(f"the checkpoint stores blocks for only some of {names}")
    if isinstance(found[0], Int8Blocks):
        return found[0] if len(found) == 1 else Int8Blocks.concatenated(found)  # type: ignore[arg-type]
    return found[0] if len(found) == 1 else Int4Blocks.concatenated(found)  # type: ignore[arg-type]

"""Quantizing a loaded model's linear layers (quantized_linear.py), and whether this machine can run them."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

import torch

from promptcache.model_runtime.errors import ModelLoadError
from promptcache.model_runtime.loading.quantized_linear import (
    GROUP_SIZE,
    HEAD,
    INT4_BF16_KERNEL_ROWS,
    INT4_DEQUANTIZE_ROWS,
    INT4_PACK_ROWS,
    INT8_DEQUANTIZE_ROWS,
    Int4Blocks,
    Int4Linear,
    Int8Linear,
    SplitByteLinear,
    WeightFormat,
    fits_int4,
)

logger = logging.getLogger(__name__)


def quantize_linears(model: torch.nn.Module, weights: WeightFormat,
                     blocks: Mapping[str, Int4Blocks] | None = None) -> int:
    """Replace a CPU model's decoder `nn.Linear` layers with Int8Linear or Int4Linear in place; returns how many.
    For int4, `blocks` (HF module name -> the checkpoint's 4-bit weights; a fused projection takes its sources'
    side by side) are used as stored; a layer the kernel cannot take (`fits_int4`) stays float. The output head
    (often the embedding, 8 bits even in 4-bit GGUF files) stays as loaded unless `blocks` holds its 8 bits
    (HEAD). Call after fusing and before packing."""
    if weights is WeightFormat.NATIVE:
        return 0
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    head_blocks = (blocks or {}).get(HEAD) if weights is WeightFormat.INT4 else None
    replaced = 0
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or child.weight.device.type != "cpu":
                continue
            dtype = child.weight.dtype
            if child is head:
                if head_blocks is None:
                    continue
                layer: torch.nn.Module = SplitByteLinear(head_blocks, dtype)  # the file's own 8 bits
            elif weights is WeightFormat.INT8:
                layer = Int8Linear(child)
            elif fits_int4(child):
                sources = getattr(parent, "JOINED_PROJECTIONS", {}).get(name, (name,))
                layer_blocks = _stored(blocks or {}, [f"{prefix}.{source}".lstrip(".") for source in sources])
                if layer_blocks is None:
                    layer_blocks = Int4Blocks.of(child.weight, child.weight.dtype)
                layer = Int4Linear(layer_blocks, child.bias, child.weight.dtype)
            else:
                logger.info("%s.%s keeps its float weight: %s x %s is not an int4 kernel shape",
                            prefix, name, child.out_features, child.in_features)
                continue
            setattr(parent, name, layer)
            replaced += 1
    return replaced


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
        for num_rows in (3, max(INT8_DEQUANTIZE_ROWS, INT4_DEQUANTIZE_ROWS, INT4_BF16_KERNEL_ROWS)):
            x = torch.randn(num_rows, 2 * GROUP_SIZE, generator=generator).to(dtype)  # [rows, in]
            with torch.no_grad():
                got = layer(x).float()
            expected = torch.nn.functional.linear(x.float(), weight, linear.bias.detach().float())
            if (got - expected).abs().max() > 0.02 * expected.abs().max():  # bf16: ~0.5 %; a bad layout: ~100 %
                return f"the {weights.value} layer disagrees with a float matmul on a probe of {num_rows} rows"
    except Exception as exc:  # an op missing from this torch build or refusing this CPU
        return f"{type(exc).__name__}: {exc}"
    return None


def _stored(blocks: Mapping[str, Int4Blocks], names: list[str]) -> Int4Blocks | None:
    """The checkpoint's blocks of the layers `names` side by side; None when it stores none of them as
    blocks. Some but not all would mix rounding schemes inside one layer: refused."""
    found = [blocks[n] for n in names if n in blocks]
    if not found:
        return None
    if len(found) < len(names):
        raise ModelLoadError(f"the checkpoint stores 4-bit blocks for only some of {names}")
    return found[0] if len(found) == 1 else Int4Blocks.concatenated(found)

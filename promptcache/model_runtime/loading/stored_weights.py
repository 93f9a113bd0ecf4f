"""Which weight format a model is served in and the checkpoint blocks that go with it: `auto` (the server's default)
serves a GGUF whose decoder layers are stored in 4 bits as stored where an int4 product with vector code runs
(`quantized_linear.int4_is_fast`; int4: the kernel reads them at a quarter of bf16's bytes, and nothing is rounded
that the file did not round); a GGUF it serves native multiplies its 8- and 4-bit blocks (Q8_0, Q5_0, Q6_K, Q4_0,
Q4_1, Q4_K layers and a Q8_0 head) from the file's bytes where our products run: in fp32 on a CPU with the AVX2
products (`exact_blocks_here`: they widen to fp32 exactly, the widened model's very weights), in bf16 with the bf16
kernels' (`bf16_blocks_here`: within a bf16 rounding of the widened model, at about half its bytes); anything else as
loaded."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from promptcache.model_runtime.errors import ModelLoadError
from promptcache.model_runtime.loading import quantized_linear
from promptcache.model_runtime.loading.quantized_linear import WeightFormat
from promptcache.model_runtime.loading.stored_linear import StoredBlocks

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoredWeights:
    """The format a model loads in (never auto); the checkpoint's blocks served as stored by HF module name (its 8-bit
    head under HEAD): for int4 its 4-bit layers, for native under auto in fp32 those that widen exactly; `wider`, the
    layers int4 keeps float (stored in more bits: never rounded to 4 bits); `reason`: why (the startup log says it)."""

    weights: WeightFormat
    reason: str
    blocks: Mapping[str, StoredBlocks] = field(default_factory=dict)
    wider: frozenset[str] = frozenset()


def choose(requested: WeightFormat, gguf: Path | None, num_heads: int, num_kv_heads: int, *, device: str,
           dtype: torch.dtype, deterministic: bool, model_type: str = "llama") -> StoredWeights:
    """Resolve `requested` for a checkpoint (`gguf`: the file it was loaded from, None for other formats; `model_type`:
    what transformers loaded it as) served on `device` in `dtype`, and read the file's blocks if it is served int4.
    Called once per load, before the model is wrapped; reads the file's header (auto) and the tensors it serves as
    stored.
    Raises ModelLoadError if the file is unreadable, or int4 is asked for a GGUF whose tensors gguf_weights does not
    map (BLOCK_ARCHITECTURES)."""

    weights, reason = requested, "asked for"
    if requested is WeightFormat.AUTO:
        weights, reason = _auto(gguf, model_type, device, dtype, deterministic)
    stored = _blocks(requested, weights, reason, gguf, num_heads, num_kv_heads, device=device, dtype=dtype,
                     deterministic=deterministic, model_type=model_type)
    if requested is WeightFormat.AUTO:
        logger.info("weights auto: %s (%s)", stored.weights.value, stored.reason)
    return stored


def _blocks(requested: WeightFormat, weights: WeightFormat, reason: str, gguf: Path | None, num_heads: int,
            num_kv_heads: int, *, device: str, dtype: torch.dtype, deterministic: bool,
            model_type: str) -> StoredWeights:
    """`weights` (resolved) with the file's blocks it serves as stored: int4's 4-bit layers and 8-bit head; under
    auto, native's 8- and 4-bit blocks where our products run (`exact_blocks_here` in fp32, `bf16_blocks_here`)."""
    from promptcache.model_runtime.loading import gguf_weights

    if weights is not WeightFormat.INT4 or gguf is None:
        exact = exact_blocks_here(device, dtype, deterministic)
        here = exact or bf16_blocks_here(device, dtype, deterministic)
        if requested is WeightFormat.AUTO and gguf is not None and here:
            blocks: dict[str, StoredBlocks] = dict(gguf_weights.read_q8_0_head(gguf))
            if model_type in gguf_weights.BLOCK_ARCHITECTURES:
                blocks |= gguf_weights.read_layers(gguf, num_heads, num_kv_heads, model_type=model_type,
                                                   int8=True).blocks
            if blocks:  # at a quarter to an eighth (fp32), a half to a quarter (bf16) of the widened layers' bytes
                how = "exact in fp32" if exact else "within a bf16 rounding of the widened weights"
                return StoredWeights(weights, f"{reason}; the file's blocks of {len(blocks)} layers multiply as stored "
                                              f"({how})", blocks)
        return StoredWeights(weights, reason)
    if model_type not in gguf_weights.BLOCK_ARCHITECTURES:
        readable = ", ".join(sorted(gguf_weights.BLOCK_ARCHITECTURES))
        raise ModelLoadError(f"int4 weights read the 4-bit blocks of {readable} GGUF files, not of {gguf.name} "
                             f"({model_type}); serve it with --weights native (or auto)")
    layers = gguf_weights.read_layers(gguf, num_heads, num_kv_heads, model_type=model_type)
    return StoredWeights(weights, reason, {**layers.blocks, **gguf_weights.read_q8_0_head(gguf)}, layers.wider)


def exact_blocks_here(device: str, dtype: torch.dtype, deterministic: bool) -> bool:
    """Whether auto serves a native GGUF's exactly widening blocks as stored: in fp32 on a CPU with the AVX2 int8 and
    int4 products (an fp16 scale times an int8, and Q4_K's scale times a nibble plus its minimum, round in fp32 as
    the widened weights do: the same weights, summed in another order)."""
    from promptcache.model_runtime import avx2

    return (device == "cpu" and dtype == torch.float32 and not deterministic and avx2.int8_ops() is not None
            and avx2.int4_ops() is not None)


def bf16_blocks_here(device: str, dtype: torch.dtype, deterministic: bool) -> bool:
    """Whether auto serves a native GGUF's 8- and 4-bit blocks as stored in bf16: where the bf16 kernels' int8 and int4
    products run. Each multiplies the file's integers exactly in bf16 and sums a group in fp32 before its scale, where
    the widened bf16 model rounds each `scale * q` to bf16 first: both within a bf16 rounding of the file's exact
    product. Gemma 3 270M's decode step (2 threads, Zen 4): its 126 projections read ~106 MB instead of 200, its
    262K x 640 head 178 MB instead of 335."""
    from promptcache.model_runtime.attention import bf16_kernel

    return (device == "cpu" and dtype == torch.bfloat16 and not deterministic and bf16_kernel.prepare()
            and bf16_kernel.int8_ops() is not None and quantized_linear.int4_kernel(dtype) is not None)


def _auto(gguf: Path | None, model_type: str, device: str, dtype: torch.dtype,
          deterministic: bool) -> tuple[WeightFormat, str]:
    """int4 for a GGUF stored in 4 bits that this machine's int4 kernel serves, else native; and why."""
    from promptcache.model_runtime.loading.gguf_weights import BLOCK_ARCHITECTURES, is_4bit

    if gguf is None:
        return WeightFormat.NATIVE, "not a GGUF checkpoint"
    if model_type not in BLOCK_ARCHITECTURES:
        return WeightFormat.NATIVE, f"int4 reads the blocks of {', '.join(sorted(BLOCK_ARCHITECTURES))} GGUF files, " \
                                    f"not {model_type}'s"
    if not is_4bit(gguf):
        return WeightFormat.NATIVE, "the GGUF stores most decoder weights in more than 4 bits"
    if device != "cpu":
        return WeightFormat.NATIVE, f"the int4 kernel runs on the CPU, not on {device}"
    if deterministic:
        return WeightFormat.NATIVE, "the batch-invariant kernels have no quantized products"
    if (problem := quantized_linear.kernel_problem(WeightFormat.INT4, dtype)) is not None:
        return WeightFormat.NATIVE, f"the int4 kernel cannot run here: {problem}"
    if not quantized_linear.int4_is_fast(dtype):
        return WeightFormat.NATIVE, "no int4 product with vector code here (PyTorch's needs AVX-512; ours, " \
                                    "`promptcache build-kernels`, AVX2 for fp32 or AVX512-BF16): slower than the " \
                                    "widened weights"
    return WeightFormat.INT4, "the GGUF stores its decoder weights in 4 bits: served as stored"

"""The AVX2 library (csrc/*.cpp): what it is compiled from and how the server gets its ops."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from promptcache.model_runtime.attention import kernel_build
from promptcache.model_runtime.attention.bf16_kernel import Int4Ops
from promptcache.model_runtime.attention.kernel_loading import PrebuiltLibrary

_CSRC = Path(__file__).parent / "csrc"
LIBRARY = kernel_build.KernelLibrary(
    name="promptcache_avx2",
    sources=tuple(_CSRC / name for name in ("int4_f32.cpp", "int8_f32.cpp", "decode_f32.cpp", "fused_f32.cpp")),
    headers=(_CSRC.parent.parent / "attention" / "csrc" / "decode_plan.h",),  # the DecodeBatch plan, shared
    # -ffp-contract=off: a product and a sum round twice, as the HF modules' ops (RoPE bit for bit); FMAs are explicit.
    cflags=("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"),
    ldflags=("-fopenmp",))
REQUIRED_FLAGS = frozenset({"avx2", "fma", "f16c"})

KERNELS = PrebuiltLibrary(LIBRARY, REQUIRED_FLAGS, "AVX2 fp32")


def int4_ops() -> Int4Ops | None:
    """The fp32 int4 product for few rows (csrc/int4_f32.cpp) if the library is loaded here, else None:
    `pack(values uint8 [out, in], scales fp32 [out, in / 32], minimums fp32 [out, in / 32])` -> three tensors
    (out % 8 == 0, in % 32 == 0) and `mm(x fp32 [rows, in], *packed) -> y fp32 [rows, out]`."""
    module = KERNELS.prepare()
    return None if module is None else Int4Ops(module.int4_pack, module.int4_mm)


@dataclass(frozen=True, slots=True)
class Int8Ops:
    """The fp32 product with 8-bit block weights for few rows (csrc/int8_f32.cpp): `pack(values int8 [out, in], scales
    fp32 [out, in / G]) -> [packed, scales]` (G = 32, or 16 for Q6_K; out % 8 == 0; scales held as fp16 where all are
    fp16 values)
    and `mm(x fp32 [rows, in], *packed) -> y fp32 [rows, out]`."""

    pack: Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]]
    mm: Callable[..., torch.Tensor]


def int8_ops() -> Int8Ops | None:
    """The fp32 Q8_0 product if the library is loaded here, else None."""
    module = KERNELS.prepare()
    return None if module is None else Int8Ops(module.int8_pack, module.int8_mm)


DECODE_HEAD_DIMS = (64, 128, 256)  # the fp32 DecodeBatch's head dims (the bf16 one's: bf16_kernel.HEAD_DIMS)


def decode_batch_type() -> Any:
    """The fp32 `DecodeBatch` (csrc/decode_f32.cpp) if the library is loaded here, else None: the bf16 kernel's
    interface (attention/decode_batch.py) for fp32 KV."""
    module = KERNELS.prepare()
    return None if module is None else module.DecodeBatch


@dataclass(frozen=True, slots=True)
class FusedOps:
    """The fused decoder layer's element-wise ops in fp32 (csrc/fused_f32.cpp; fused_layers.LayerOps):
    `rms_norm(x [N, H], weight [H], eps)`, `silu_mul(gate_up [N, 2I]) -> [N, I]` and
    `rope_qk(qkv [N, (H + 2 H_kv) D], cos [N, D], sin [N, D], H, H_kv) -> [q [N, H, D], k [N, H_kv, D]]`."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    rope_qk: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], list[torch.Tensor]]


def fused_ops() -> FusedOps | None:
    """The fp32 layer ops if the library is loaded here, else None."""
    module = KERNELS.prepare()
    return None if module is None else FusedOps(module.rms_norm, module.silu_mul, module.rope_qk)

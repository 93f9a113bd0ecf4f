"""The bf16 flash-attention kernel for AVX512-BF16 CPUs (csrc/, built by `promptcache build-kernels`, only loaded here):
2-2.8x PyTorch's fused op without AMX, K/V read as segments where they lie (one softmax). The same library carries the
fused decoder-layer ops and the int4 product. Without it, attention keeps PyTorch's fused op."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from promptcache.model_runtime.attention import kernel_build, kernel_loading
from promptcache.model_runtime.cpu_features import cpu_flags

log = logging.getLogger(__name__)

REQUIRED_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
HEAD_DIMS = (64, 128, 256)  # 256: Gemma 3

# (q [H, M, D], keys [[H_kv, N_i, D], ...], values (the same shapes), scale, causal[, first_rows])
#   -> [out [H, M, D], lse [H, M] fp32]: attention over the segments' concatenation (N = sum N_i), each
#   segment read where it lies; a causal mask is bottom-right aligned on the concatenation; query rows
#   before a segment's entry of `first_rows` (default all 0) do not see it.
Kernel = Callable[..., list[torch.Tensor]]
# (q [B, H, D] one query row per decoding sequence, [[k segments] per sequence], [[v segments]], scale)
#   -> [out [B, H, D], lse [B, H] fp32]: each sequence attends the concatenation of its own segments.
DecodeKernel = Callable[[torch.Tensor, list[list[torch.Tensor]], list[list[torch.Tensor]], float], list[torch.Tensor]]


@dataclass(frozen=True, slots=True)
class FusedOps:
    """The decoder layer's element-wise ops built with the kernel (csrc/fused_bf16.cpp), bf16 only:
    `rms_norm(x [N, H], weight [H], eps)`, `silu_mul(gate_up [N, 2I]) -> [N, I]` and
    `rope_qk(qkv [N, (H + 2 H_kv) D], cos [N, D], sin [N, D], H, H_kv) -> [q [N, H, D], k [N, H_kv, D]]`;
    KeyShifter's rotation, `shift_keys(out [B, n, D], keys [B, n, D], cos [n, R/2], sin [n, R/2])`; and Gemma's
    RMSNorm, `rms_norm_scaled(x [N, H], scale [H] fp32, eps)`: x * rsqrt(mean(x^2) + eps) * scale rounded once, and
    its MLP's `gelu_tanh_mul(gate_up [N, 2I]) -> [N, I]`."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    rope_qk: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], list[torch.Tensor]]
    shift_keys: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    rms_norm_scaled: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    gelu_tanh_mul: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Int4Ops:
    """The weight-only int4 product for few rows built with the kernel (csrc/int4_bf16.cpp):
    `pack(values uint8 [out, in], scales fp32 [out, in / 32], minimums fp32 [out, in / 32]) -> packed`
    (three tensors, out % 16 == 0, in % 32 == 0; scales and minimums held as fp16 where all are fp16 values,
    as GGUF's Q4_1 stores them) and `mm(x bf16 [rows, in], *packed) -> y bf16 [rows, out]`."""

    pack: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], list[torch.Tensor]]
    mm: Callable[..., torch.Tensor]


@dataclass(frozen=True, slots=True)
class Int8Ops:
    """The weight-only product with a GGUF's 8-bit blocks for few rows (csrc/int8_bf16.cpp), avx2.Int8Ops' interface
    for bf16 activations: `pack(values int8 [out, in], scales fp32 [out, in / G]) -> packed` (two tensors; out % 16
    == 0, G = 32 or 16; scales held as fp16 where all are fp16 values), `mm(x bf16 [rows, in], *packed) -> y bf16
    [rows, out]`, and `dequantize(*packed) -> W bf16 [out, in]`, bf16(scale * q), for many rows."""

    pack: Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]]
    mm: Callable[..., torch.Tensor]
    dequantize: Callable[..., torch.Tensor]


# "kernel", "decode", "decode_batch", "ops", "int4" and "int8" once prepare() has run (None if unavailable: "reason"
# says why)
_state: dict[str, Any] = {}


def supported() -> bool:
    """Whether this CPU has the instructions the kernel is compiled for."""
    return cpu_flags() >= REQUIRED_FLAGS


def prepare() -> bool:
    """Load the kernel built ahead of time for this torch (never compiles); True when attention can use it."""
    if "kernel" not in _state:
        missing = sorted(REQUIRED_FLAGS - cpu_flags())
        module = _load() if not missing else None
        names = ("kernel", "decode", "decode_batch", "ops", "int4", "int8")
        _state.update(dict.fromkeys(names) if module is None else {
            "kernel": module.flash_bf16, "decode": module.decode_bf16, "decode_batch": module.DecodeBatch,
            "ops": FusedOps(module.rms_norm, module.silu_mul, module.rope_qk, module.shift_keys,
                            module.rms_norm_scaled, module.gelu_tanh_mul),
            "int4": Int4Ops(module.int4_pack, module.int4_mm),
            "int8": Int8Ops(module.int8_pack, module.int8_mm, module.int8_dequantize)})
        if missing:
            _state["reason"] = f"the CPU lacks {', '.join(missing)}"
            log.info("bf16 attention kernel not used: %s", _state["reason"])
    return _state["kernel"] is not None


def unavailable_reason() -> str | None:
    """Why `prepare()` did not load the kernel (no file paths: /health shows it), None if it did or has not run."""
    return None if _state.get("kernel") is not None else _state.get("reason")


def loaded() -> Kernel | None:
    """The kernel if `prepare()` loaded it in this process, else None (never builds)."""
    return _state.get("kernel")


def decode_loaded() -> DecodeKernel | None:
    """The batch decode entry (one call for every decoding sequence of a layer) if loaded, else None."""
    return _state.get("decode")


def decode_batch_type() -> Any:
    """The kernel's `DecodeBatch` class if loaded, else None: `DecodeBatch(own_keys, own_values, own_lens, segment_keys,
    segment_values, segment_members)` (tensors [L, H_kv, N, D]), then per layer `attend(q [B, H, D], layer, scale)`."""
    return _state.get("decode_batch")


def fused_ops() -> FusedOps | None:
    """The fused element-wise ops if `prepare()` loaded the kernel, else None."""
    return _state.get("ops")


def int4_ops() -> Int4Ops | None:
    """The int4 product for few rows if `prepare()` loaded the kernel, else None."""
    return _state.get("int4")


def int8_ops() -> Int8Ops | None:
    """The 8-bit block product for few rows if `prepare()` loaded the kernel, else None."""
    return _state.get("int8")


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> Kernel | None:
    """The kernel when it can run this call (bf16 on CPU, HEAD_DIMS, last dims contiguous); v defaults to k's layout."""
    kernel = loaded()
    v = k if v is None else v
    if kernel is None or q.device.type != "cpu" or q.shape[-1] not in HEAD_DIMS or k.shape[1] == 0:
        return None
    bf16 = q.dtype == k.dtype == v.dtype == torch.bfloat16
    return kernel if bf16 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 else None


def _load() -> Any:
    """Import this torch's prebuilt library, or None (the reason in `_state`, the details in the log)."""
    path = kernel_build.library_path()
    if not path.exists():
        why = kernel_build.compiler_missing()
        _state["reason"] = ("no kernel library built for this torch; `promptcache build-kernels` builds it"
                            + (f" (here it cannot: {why})" if why else ""))
        log.warning("bf16 attention kernel not found at %s: %s; using PyTorch's fused attention",
                    path, _state["reason"])
        return None
    try:
        module = kernel_loading.load_library(path)
    except kernel_loading.KernelLoadError as error:  # refused (owner, mode, symlink), damaged, no libgomp
        _state["reason"] = str(error)
        log.warning("bf16 attention kernel at %s not loaded: %s%s; using PyTorch's fused attention", path, error,
                    f" ({error.__cause__})" if error.__cause__ else "")
        return None
    log.info("bf16 attention kernel loaded from %s", path)
    return module

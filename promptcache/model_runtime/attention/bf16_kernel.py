"""The bf16 flash-attention kernel for CPUs with AVX512-BF16 (csrc/flash_bf16.cpp), built on first use.

PyTorch's fused CPU attention runs bf16 on bf16 tiles only with AMX; on AVX512-BF16 CPUs without AMX
(AMD Zen 4, Intel Cooper Lake) it computes at fp32 speed, which held `--dtype auto` to 1.4-1.9x over fp32
on a 2K-token prefill (issue 16). This kernel does QK^T and PV on `vdpbf16ps`: 2.6-2.8x faster than the
fused op on a 2K-token causal prefill, 2x on decode rows over 8K shared keys (docs/benchmarks.md). It takes
K and V as lists of segments (csrc/pack_bf16.cpp reads each where it lies), so a request's modules, its
earlier tokens and its new ones are one call with one softmax instead of a call and a merge each.
The same extension carries the decoder layers' fused element-wise ops (csrc/fused_bf16.cpp, `fused_ops()`,
used by model_runtime/fused_layers.py): one build, one set of CPU requirements.

`prepare()` compiles it once per machine (about 25-60 s; then torch's extension cache loads it in about a
second) and is called where a model is loaded or a runner built for bf16 on a CPU that has the
instructions; attention code asks `loaded()`, which never compiles, so no request waits for a build.
Without a C++ compiler, ninja or the CPU flags, `prepare()` logs why and returns False, attention keeps
PyTorch's fused op and models keep the Hugging Face modules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from promptcache.model_runtime.cpu_features import cpu_flags

log = logging.getLogger(__name__)

REQUIRED_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
HEAD_DIMS = (64, 128)
SOURCES = tuple(Path(__file__).parent / "csrc" / name
                for name in ("flash_bf16.cpp", "pack_bf16.cpp", "fused_bf16.cpp"))
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-fopenmp"]

# (q [H, M, D], keys [[H_kv, N_i, D], ...], values (the same shapes), scale, causal[, first_rows])
#   -> [out [H, M, D], lse [H, M] fp32]: attention over the segments' concatenation (N = sum N_i), each
#   segment read where it lies; a causal mask is bottom-right aligned on the concatenation; query rows
#   before a segment's entry of `first_rows` (default all 0) do not see it.
Kernel = Callable[..., list[torch.Tensor]]


@dataclass(frozen=True, slots=True)
class FusedOps:
    """The decoder layer's element-wise ops built with the kernel (csrc/fused_bf16.cpp), bf16 only:
    `rms_norm(x [N, H], weight [H], eps)`, `silu_mul(gate_up [N, 2I]) -> [N, I]` and
    `rope_qk(qkv [N, (H + 2 H_kv) D], cos [N, D], sin [N, D], H, H_kv) -> [q [N, H, D], k [N, H_kv, D]]`;
    and KeyShifter's rotation, `shift_keys(out [B, n, D], keys [B, n, D], cos [n, R/2], sin [n, R/2])`."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    rope_qk: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], list[torch.Tensor]]
    shift_keys: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


_state: dict[str, Any] = {}  # "kernel" and "ops" once prepare() has run: each None if unavailable


def supported(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU has the instructions the kernel is compiled for."""
    return (cpu_flags() if flags is None else flags) >= REQUIRED_FLAGS


def prepare() -> bool:
    """Build (first time on this machine) and load the kernel; True when attention can use it."""
    if "kernel" not in _state:
        module = _build() if supported() else None
        _state["kernel"] = None if module is None else module.flash_bf16
        _state["ops"] = None if module is None else FusedOps(module.rms_norm, module.silu_mul, module.rope_qk,
                                                              module.shift_keys)
        if _state["kernel"] is None and not supported():
            log.info("bf16 attention kernel not used: the CPU lacks %s", sorted(REQUIRED_FLAGS - cpu_flags()))
    return _state["kernel"] is not None


def loaded() -> Kernel | None:
    """The kernel if `prepare()` loaded it in this process, else None (never builds)."""
    return _state.get("kernel")


def fused_ops() -> FusedOps | None:
    """The fused element-wise ops if `prepare()` loaded the kernel in this process, else None."""
    return _state.get("ops")


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> Kernel | None:
    """The kernel when it can run this call (bf16 on CPU, head dim 64 or 128, last dims contiguous);
    v defaults to k's layout (a dispatcher that only sees q and k)."""
    kernel = loaded()
    v = k if v is None else v
    if kernel is None or q.device.type != "cpu" or q.shape[-1] not in HEAD_DIMS or k.shape[1] == 0:
        return None
    if not (q.dtype == k.dtype == v.dtype == torch.bfloat16):
        return None
    return kernel if q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 else None


def _build() -> Any:
    try:
        from torch.utils.cpp_extension import load

        module = load(name="promptcache_bf16", sources=[str(source) for source in SOURCES], extra_cflags=CFLAGS,
                      extra_ldflags=["-fopenmp"], verbose=False)
    except (OSError, RuntimeError, ImportError) as error:  # no compiler, no ninja, a failed build
        log.warning("bf16 attention kernel not built (%s); using PyTorch's fused attention", error)
        return None
    return module

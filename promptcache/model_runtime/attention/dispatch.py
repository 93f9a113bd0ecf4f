"""Pick a kernel per call. On a CPU the fused op beat the matmul at every size measured and, in bf16 on AVX512-BF16,
our kernel beat both; the matmul stays for masked calls, tiny work and as the reference. On a GPU (GPU_DEVICE_TYPES)
every backend but `matmul` runs `gpu_segment_attend`, split over the keys where one call would leave SMs idle."""

from __future__ import annotations

from collections.abc import Callable

import torch

from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.attention.backends import bf16_cpu_attend, fused_cpu_attend, matmul_attend
from promptcache.model_runtime.attention.gpu_backends import gpu_attend, kernel_block_rows
from promptcache.model_runtime.attention.split_keys import num_sms, num_splits, split_attend

# Device types whose calls take the GPU kernels.
GPU_DEVICE_TYPES = frozenset({"cuda"})

# rows x keys per KV group from which the fused CPU op wins (the smallest size measured: 1 row x 16 keys).
FUSED_MIN_WORK = 16
# T x T x G for a causal block of T new tokens: below it the masked matmul instead of the fused op on KV
# expanded to every head. On Zen 4 the fused op won at every size measured, 1.4-2.4x for T = 2..128
# (attention_thresholds.py --causal; on an AVX2 EPYC the matmul won below 64K): used throughout.
CAUSAL_FUSED_MIN_WORK = 0
# Decode: a sequence with at least this many own keys attends them in place with one fused call of its own;
# shorter ones share one packed batch call (which copies every sequence's KV each layer). Per layer, batch 32,
# measured when that call padded to the longest: 64 own keys padded 1.06 ms vs fused per sequence 1.26 ms;
# 128: 2.36 vs 1.50; 2048: 46.8 vs 12.2.
OWN_DECODE_FUSED_MIN_KEYS = 128


def on_gpu(t: torch.Tensor) -> bool:
    """Whether `t`'s device takes the GPU kernels."""
    return t.device.type in GPU_DEVICE_TYPES


def decode_in_place(backend: str, q: torch.Tensor, num_own_keys: int) -> bool:
    """Whether a decoding sequence's own KV is attended in place by a fused call of its own (CPU only)."""
    return backend in ("auto", "fused_cpu") and q.device.type == "cpu" and num_own_keys >= OWN_DECODE_FUSED_MIN_KEYS


def gpu_segment_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H_kv, M, D] attends k/v [H_kv, N, D] on a GPU, split over the keys when one call would leave SMs idle
    (masked calls: the matmul); out [H_kv, M, D], lse [H_kv, M] fp32."""
    if mask is not None:
        return matmul_attend(q, k, v, scale, mask)
    num_blocks = q.shape[0] * -(-q.shape[1] // kernel_block_rows(q))
    splits = num_splits(num_blocks, k.shape[1], num_sms(q.device))
    if splits > 1:
        return split_attend(gpu_attend, q, k, v, scale, splits)
    out, lse = gpu_attend(q[None], k[None], v[None], scale)  # [1, H_kv, M, D], [1, H_kv, M]
    return out[0], lse[0]


# Named backends on a CPU. On a GPU every name but "matmul" means gpu_segment_attend, so a "flash" or
# "fused_cpu" config works on either device; "flash" on a CPU is the reference kernel (causal blocks: fused op).
BACKENDS = {"matmul": matmul_attend, "fused_cpu": fused_cpu_attend, "flash": matmul_attend}


def choose(backend: str, q: torch.Tensor, k: torch.Tensor) -> Callable:
    """The kernel for one call: q [H_kv, M, D] against k [H_kv, N, D] (N > 0)."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected auto or one of {sorted(BACKENDS)}")
    if on_gpu(q):
        return matmul_attend if backend == "matmul" else gpu_segment_attend
    if backend != "auto":
        return BACKENDS[backend]
    if q.shape[1] * k.shape[1] < FUSED_MIN_WORK:
        return matmul_attend
    return bf16_cpu_attend if bf16_kernel.eligible(q, k) is not None else fused_cpu_attend

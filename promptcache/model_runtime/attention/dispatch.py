"""Pick a kernel per call. Thresholds measured by benchmarks/attention_thresholds.py (2 threads, fp32,
head_dim 64): the fused CPU op beat the plain matmul at every measured size, from 1 query row x 16 keys
(24 us vs 54 us) to 256 rows x 4096 keys (4.1 ms vs 26.9 ms) — see docs/benchmarks.md. The matmul path
stays for masked calls, for work below the smallest size measured, and as the reference kernel."""

from __future__ import annotations

from collections.abc import Callable

import torch

from promptcache.model_runtime.attention.backends import BACKENDS, fused_cpu_attend, matmul_attend

# rows x keys per KV group from which the fused CPU op wins (the smallest size measured).
FUSED_MIN_WORK = 16
# T x T x G for a causal block of T new tokens: below it the masked matmul is cheaper than expanding KV.
CAUSAL_FUSED_MIN_WORK = 64 * 1024


def choose(backend: str, q: torch.Tensor, k: torch.Tensor) -> Callable:
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; expected auto or one of {sorted(BACKENDS)}")
        return BACKENDS[backend]
    if q.is_cuda:
        return BACKENDS["flash"]
    return fused_cpu_attend if q.shape[1] * k.shape[1] >= FUSED_MIN_WORK else matmul_attend

"""Pick a kernel per call. Thresholds measured by benchmarks/attention_thresholds.py (2 threads):
below FUSED_MIN_WORK score elements the fused op's call overhead loses to a plain matmul."""

from __future__ import annotations

from collections.abc import Callable

import torch

from promptcache.model_runtime.attention.backends import BACKENDS, fused_cpu_attend, matmul_attend

# rows x keys per KV group at which the fused CPU op starts to win (see docs/benchmarks.md).
FUSED_MIN_WORK = 16 * 1024
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

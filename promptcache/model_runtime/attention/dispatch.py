"""Pick a kernel per call. Thresholds measured by benchmarks/attention_thresholds.py (2 threads, fp32,
head_dim 64): the fused CPU op beat the plain matmul at every measured size, from 1 query row x 16 keys
(24 us vs 54 us) to 256 rows x 4096 keys (4.1 ms vs 26.9 ms) — see docs/benchmarks.md. The matmul path
stays for masked calls, for work below the smallest size measured, and as the reference kernel. In bf16
on a CPU with AVX512-BF16, `auto` uses our kernel (bf16_kernel.py) wherever the fused op would run: it was
faster at every shape measured, from 8 causal tokens to 224 rows x 8K keys (docs/benchmarks.md)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.attention.backends import (
    BACKENDS,
    bf16_cpu_attend,
    fused_cpu_attend,
    matmul_attend,
)

# rows x keys per KV group from which the fused CPU op wins (the smallest size measured).
FUSED_MIN_WORK = 16
# T x T x G for a causal block of T new tokens: below it the masked matmul instead of the fused op on KV
# expanded to every head. On the AVX2 EPYC the masked matmul was cheaper below 64K; on the Zen 4 (AVX-512)
# the fused op won at every size measured, 1.4-2.4x, T = 2..128 in fp32 and bf16
# (benchmarks/attention_thresholds.py --causal, results/causal_threshold.jsonl): 9 new tokens, bf16,
# 61 vs 107 us a layer. The fused op is used throughout; the matmul stays the reference kernel.
CAUSAL_FUSED_MIN_WORK = 0
# Decode: a sequence with at least this many own keys attends them in place with one fused call of its own;
# shorter ones share one padded batch call. Measured (Qwen2.5-0.5B head shape, 2 threads, batch 32, per
# layer): 64 own keys padded 1.06 ms vs fused per sequence 1.26 ms; 128: 2.36 vs 1.50; 1024: 24.4 vs 7.0;
# 2048: 46.8 vs 12.2 (the padded call copies every sequence's KV each layer of each step).
OWN_DECODE_FUSED_MIN_KEYS = 128


def decode_in_place(backend: str, q: torch.Tensor, num_own_keys: int) -> bool:
    """Whether a decoding sequence's own KV is attended in place by a fused call of its own."""
    return backend in ("auto", "fused_cpu") and not q.is_cuda and num_own_keys >= OWN_DECODE_FUSED_MIN_KEYS


def choose(backend: str, q: torch.Tensor, k: torch.Tensor) -> Callable:
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; expected auto or one of {sorted(BACKENDS)}")
        return BACKENDS[backend]
    if q.is_cuda:
        return BACKENDS["flash"]
    if q.shape[1] * k.shape[1] < FUSED_MIN_WORK:
        return matmul_attend
    return bf16_cpu_attend if bf16_kernel.eligible(q, k) is not None else fused_cpu_attend

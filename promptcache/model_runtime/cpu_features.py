"""CPU feature flags read once from `/proc/cpuinfo` (none elsewhere) and the dtype `--dtype auto` picks: bf16
only with native bf16 arithmetic (AMX `amx_bf16`, AVX-512 `avx512_bf16`: 2.6x over fp32 for a 2K-token SmolLM2
prefill on an AMX CPU); emulated bf16 is slower than fp32, so `auto` keeps fp32 there."""

from __future__ import annotations

import functools
from pathlib import Path

BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


@functools.cache
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags of the first CPU listed (empty when the OS does not say)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):  # x86 | arm64
            return frozenset(value.split())
    return frozenset()


def auto_dtype(device: str, flags: frozenset[str] | None = None) -> str:
    """`bfloat16` on CUDA and on CPUs with native bf16 (BF16_CPU_FLAGS); `float32` otherwise."""
    native = device.startswith("cuda") or BF16_CPU_FLAGS & (cpu_flags() if flags is None else flags)
    return "bfloat16" if native else "float32"

"""The batch-invariant CPU kernels (csrc/, built by `promptcache build-kernels` on any x86-64 with AVX2 and FMA, only
loaded here): linear layers, RMSNorm, the SiLU gate and attention whose result for a row is one fixed sequence of
fp32 operations on that row's inputs, whatever else the step holds and however its keys are split."""

from __future__ import annotations

from pathlib import Path

from promptcache.model_runtime.attention import kernel_build
from promptcache.model_runtime.attention.kernel_loading import PrebuiltLibrary

_CSRC = Path(__file__).parent / "csrc"
# -ffp-contract=off: no multiply and add fused unless the source says so (an FMA rounds once, a pair twice).
LIBRARY = kernel_build.KernelLibrary(
    name="promptcache_det",
    sources=tuple(_CSRC / name for name in ("det_ops.cpp", "det_linear.cpp", "det_attention.cpp")),
    headers=(_CSRC / "det_common.h",),
    cflags=("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"),
    ldflags=("-fopenmp",))
REQUIRED_FLAGS = frozenset({"avx2", "fma"})

KERNELS = PrebuiltLibrary(LIBRARY, REQUIRED_FLAGS, "batch-invariant")
supported = KERNELS.supported
prepare = KERNELS.prepare
unavailable_reason = KERNELS.unavailable_reason

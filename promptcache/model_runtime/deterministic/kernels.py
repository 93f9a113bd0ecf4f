"""The batch-invariant CPU kernels (csrc/, built by `promptcache build-kernels` on any x86-64 with AVX2 and FMA, only
loaded here): linear layers, RMSNorm, the SiLU gate and attention whose result for a row is one fixed sequence of
fp32 operations on that row's inputs, whatever else the step holds and however its keys are split."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from promptcache.model_runtime.attention import kernel_build, kernel_loading
from promptcache.model_runtime.cpu_features import cpu_flags

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
# -ffp-contract=off: no multiply and add fused unless the source says so (an FMA rounds once, a pair twice).
LIBRARY = kernel_build.KernelLibrary(
    name="promptcache_det",
    sources=tuple(_CSRC / name for name in ("det_ops.cpp", "det_linear.cpp", "det_attention.cpp")),
    headers=(_CSRC / "det_common.h",),
    cflags=("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"),
    ldflags=("-fopenmp",))
REQUIRED_FLAGS = frozenset({"avx2", "fma"})

_state: dict[str, Any] = {}  # "module" once prepare() ran (None: unavailable, "reason" says why)


def supported() -> bool:
    """Whether this CPU has the instructions the kernels are compiled for."""
    return cpu_flags() >= REQUIRED_FLAGS


def prepare() -> Any:
    """Load the library built ahead of time for this torch (never compiles); the module, or None."""
    if "module" not in _state:
        missing = sorted(REQUIRED_FLAGS - cpu_flags())
        if missing:
            _state.update(module=None, reason=f"the CPU lacks {', '.join(missing)}")
        else:
            _state["module"] = _load(kernel_build.library_path(library=LIBRARY))
    return _state["module"]


def unavailable_reason() -> str | None:
    """Why `prepare()` found no library (None if it did or has not run)."""
    return None if _state.get("module") is not None else _state.get("reason")


def _load(path: Path) -> Any:
    if not path.exists():
        why = kernel_build.compiler_missing()
        _state["reason"] = ("no batch-invariant kernel library built for this torch; `promptcache build-kernels` "
                            "builds it" + (f" (here it cannot: {why})" if why else ""))
        return None
    try:
        module = kernel_loading.load_library(path)
    except kernel_loading.KernelLoadError as error:  # refused (owner, mode, symlink), damaged, no libgomp
        _state["reason"] = str(error)
        log.warning("batch-invariant kernels at %s not loaded: %s%s", path, error,
                    f" ({error.__cause__})" if error.__cause__ else "")
        return None
    log.info("batch-invariant kernels loaded from %s", path)
    return module

"""Whether the Triton kernels' tests can run here: compiled on a GPU, or on the CPU in Triton's interpreter, which
must be on before Triton is first imported (`TRITON_INTERPRET=1`; scripts/test.sh runs these files in a pytest
process of their own so) and which fails under NumPy >= 2.4 before Triton 3.9 (triton-lang/triton#9171)."""

from __future__ import annotations

import importlib.metadata
import os

import numpy as np
import pytest
import torch

INTERPRETER_NUMPY_FIXED_IN = (3, 9)  # Triton 3.9's interpreter ran these tests under NumPy 2.4.6; 3.6's fails there


def skip_unless_kernels_run() -> str:
    """The device the kernels run on ("cuda", or "cpu" under the interpreter); skips the calling module otherwise."""
    if torch.cuda.is_available():
        pytest.importorskip("triton")
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU, and Triton's interpreter is off (TRITON_INTERPRET=1)", allow_module_level=True)
    pytest.importorskip("triton")
    version = tuple(int(part) for part in importlib.metadata.version("triton").split(".")[:2])
    if version < INTERPRETER_NUMPY_FIXED_IN and np.lib.NumpyVersion(np.__version__) >= "2.4.0":
        pytest.skip(f"Triton {'.'.join(map(str, version))}'s interpreter needs NumPy < 2.4", allow_module_level=True)
    return "cpu"

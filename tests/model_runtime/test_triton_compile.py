"""The shared-prefix Triton kernels compile for the GPUs this work is lent (sm_90: H100/H200) in every variant the
engine launches (bf16 and fp16, with and without a sliding window), here, without a GPU: Triton's front end and
ptxas run on the CPU. The interpreter (test_triton_shared.py) runs the kernels' Python and accepts what a compiled
kernel refuses (a global that is not a constexpr, for one); this test catches that before a GPU session does."""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("Triton's interpreter is on: nothing is compiled", allow_module_level=True)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from promptcache.model_runtime.attention import shared_prefix

TARGET = GPUTarget("cuda", 90, 32)
INTS = {"stride_qt", "stride_qh", "stride_ph", "stride_ps", "layer", "num_rows", "num_seqs", "num_chunks", "num_parts",
        "window"}
INT_POINTERS = {"token_ptr": "*i32", "segment_rows_ptr": "*i32", "seq_ptr": "*i32", "segment_ptr": "*i64",
                "query_pos_ptr": "*i32", "key_pos_ptr": "*i32", "pos_start_ptr": "*i32", "lse_ptr": "*fp32",
                "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
KV_POINTERS = {"q_ptr", "kv_ptr", "pool_k_ptr", "pool_v_ptr", "out_ptr"}


def _ptxas_found() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(TARGET.arch)
    except (ImportError, RuntimeError, OSError):
        return False
    return True


def _compile(kernel, dtype: str, constants: dict) -> None:
    """Compile `kernel` (a @triton.jit function) for TARGET with `constants` and the rest typed by name."""
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in INTS:
            signature[name] = "i32"
        elif name == "scale":
            signature[name] = "fp32"
        elif name in KV_POINTERS:
            signature[name] = f"*{dtype}"
        else:
            signature[name] = INT_POINTERS[name]  # a new argument: type it here
    fixed = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Triton's notice about its FP-fusion default
        triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=fixed), target=TARGET)


@pytest.mark.skipif(not _ptxas_found(), reason="Triton's ptxas is not available")
@pytest.mark.parametrize("windowed", [False, True], ids=["full", "window"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_shared_prefix_kernels_compile_for_sm90(dtype, windowed):
    assert shared_prefix.load_kernel()
    from promptcache.model_runtime.attention import triton_shared as kernels

    common = dict(windowed=windowed, group=4, head_dim=256, block_d=256, block_keys=kernels.BLOCK_KEYS,
                  precision="tf32", upcast=False)  # Gemma 3's 256-wide heads, GQA 4
    _compile(kernels._shared_partials, dtype, dict(common, block_rows=kernels.BLOCK_ROWS))
    _compile(kernels._own_and_merge, dtype, dict(common, num_heads=4, block_rows=kernels.MIN_DOT))

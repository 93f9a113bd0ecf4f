"""GPU attention kernels returning (out, natural-log lse): flash-attn and FlashInfer where importable and applicable
(one whose call fails is turned off with a warning), then torch's CUDA ops, then the matmul. q [B, H, M, D], k/v
[B, H, N, D] (N > 0, equal head counts), scale, `causal` (square blocks only); out [B, H, M, D], lse [B, H, M] fp32."""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.bias import causal_lower_right

from promptcache.model_runtime.attention.backends import matmul_attend

log = logging.getLogger(__name__)

LOG_2 = math.log(2.0)
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
EFFICIENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EFFICIENT_ALIGNMENT_BYTES = 16  # the efficient op reads head_dim in 16-byte vectors

Result = tuple[torch.Tensor, torch.Tensor]


def flash_applicable(q: torch.Tensor) -> bool:
    """Whether the flash kernels (torch's and flash-attn's) take this dtype and head dim."""
    head_dim = q.shape[-1]
    return q.dtype in FLASH_DTYPES and head_dim <= FLASH_MAX_HEAD_DIM and head_dim % 8 == 0


def aten_flash_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False) -> Result:
    """torch's flash-attention op (fp16/bf16): lse [B, H, M] fp32, natural log."""
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]


def aten_efficient_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          causal: bool = False) -> Result:
    """torch's memory-efficient op (fp32/fp16/bf16); its lse is [B, H, ceil(M / 32) * 32], sliced to M rows."""
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale)[:2]  # [B, H, M, D], [B, H, M_padded]
    return out, lse[..., : q.shape[2]]


_libraries: dict[str, Any] = {}  # module name -> module, or None when not importable or turned off


def _library(name: str) -> Any:
    if name not in _libraries:
        try:
            _libraries[name] = importlib.import_module(name)
        except (ImportError, OSError, RuntimeError):  # absent, or built against another torch/CUDA
            _libraries[name] = None
    return _libraries[name]


def flash_attn_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      causal: bool = False) -> Result | None:
    """flash-attn's kernel when importable and applicable, else None."""
    library = _library("flash_attn")
    if library is None or not q.is_cuda or not flash_applicable(q):
        return None
    # flash-attn's layout is [B, M, H, D]: transposed views, the last dim stays contiguous.
    out, lse, _ = library.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          softmax_scale=scale, causal=causal, return_attn_probs=True)
    return out.transpose(1, 2), lse.float()  # [B, H, M, D], [B, H, M]


def flashinfer_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      causal: bool = False) -> Result | None:
    """FlashInfer's single-request prefill kernel (batch 1 only) when importable and applicable, else None."""
    library = _library("flashinfer")
    if library is None or not q.is_cuda or q.shape[0] != 1 or not flash_applicable(q):
        return None
    out, lse = library.single_prefill_with_kv_cache(
        q[0].transpose(0, 1).contiguous(), k[0], v[0], causal=causal, kv_layout="HND", sm_scale=scale,
        return_lse=True)  # [M, H, D], [M, H] (base-2 lse)
    return out.transpose(0, 1).unsqueeze(0), (lse.float() * LOG_2).transpose(0, 1).unsqueeze(0)


OPTIONAL_KERNELS: dict[str, Callable[..., Result | None]] = {
    "flash_attn": flash_attn_attend, "flashinfer": flashinfer_attend}


def gpu_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False) -> Result:
    """The first applicable kernel: flash-attn, FlashInfer, torch's flash op, its efficient op, matmul."""
    for name, kernel in OPTIONAL_KERNELS.items():
        if _libraries.get(name, ...) is None:
            continue  # known absent or turned off
        try:
            found = kernel(q, k, v, scale, causal)
        except (RuntimeError, ValueError, TypeError) as error:  # an unsupported case: torch's ops take it
            log.warning("%s failed (%s); using torch's attention ops from now on", name, error)
            _libraries[name] = None
            continue
        if found is not None:
            return found
    if flash_applicable(q):
        return aten_flash_attend(q, k, v, scale, causal)
    if q.dtype in EFFICIENT_DTYPES and q.shape[-1] % (EFFICIENT_ALIGNMENT_BYTES // q.element_size()) == 0:
        return aten_efficient_attend(q, k, v, scale, causal)
    # The reference kernel; a causal mask is made per call (a cache would keep [M, N] masks in GPU memory).
    m, n = q.shape[-2], k.shape[-2]
    mask = torch.ones((m, n), dtype=torch.bool, device=q.device).tril(n - m) if causal else None  # [M, N]
    return matmul_attend(q, k, v, scale, mask)


# The concatenated path's KV copy, expanded to every query head, at most this large (bytes): beyond it the
# copy's memory, not launches, is what a call costs, and segments are attended where they lie.
CONCATENATED_MAX_BYTES = 256 << 20


def concatenated_reads_groups(q: torch.Tensor) -> bool:
    """Whether `attend_concatenated` reads grouped KV as it is (flash: SDPA's enable_gqa, no copy per query
    head); otherwise it expands KV to every query head."""
    return flash_applicable(q)


def attend_concatenated(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        scale: float) -> torch.Tensor:
    """q [T, H, D], one sequence's queries, attends the concatenation of `keys`/`values` ([H_kv, N_i, D], N >= T)
    whose last T keys are its own tokens (causal, bottom-right) in one SDPA call: on a GPU the KV copy costs
    microseconds where each call and merge per segment costs a launch. Returns out [T, H, D] (q's dtype)."""
    num_rows, num_heads, _ = q.shape
    k = torch.cat(keys, dim=1) if len(keys) > 1 else keys[0]             # [H_kv, N, D]
    v = torch.cat(values, dim=1) if len(values) > 1 else values[0]
    group = num_heads // k.shape[0]
    grouped = group > 1 and concatenated_reads_groups(q)
    if group > 1 and not grouped:  # the efficient kernel takes equal head counts (with enable_gqa: math)
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # [H, N, D]
    mask = None if num_rows == 1 else causal_lower_right(num_rows, k.shape[1])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=grouped)  # [1, H, T, D]
    return out[0].transpose(0, 1)


def kernel_block_rows(q: torch.Tensor) -> int:
    """Query rows per thread block of the torch op `gpu_attend` would run (flash: 128, efficient: 64)."""
    return 128 if flash_applicable(q) else 64

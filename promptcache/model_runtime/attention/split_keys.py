"""Split-K for shared KV on a GPU: few query rows over a long segment launch too few thread blocks (32 decoding
sequences over 8K keys, 4 KV heads: ~8 blocks on 132 SMs), so the keys are cut into equal chunks run as one
call's batch dimension, the partial results merged in fp32 by their log-sum-exp (Hydragen eq. 5)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from promptcache.model_runtime.attention.lse_merge import merge_stacked

# Keys per chunk below which a split costs more in merging than it gains in parallelism (a prediction:
# 8K shared keys then split 16-way, docs/gpu design; benchmarks/kernels/gpu_attention.py measures it).
MIN_KEYS_PER_SPLIT = 512
# SMs assumed for a device that reports none (the meta device in tests): an H100's 132.
DEFAULT_NUM_SMS = 132

Attend4 = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # q [B, H, M, D], k, v, scale -> out, lse


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (DEFAULT_NUM_SMS for a device type without properties)."""
    return _cuda_sms(device.index or 0) if device.type == "cuda" else DEFAULT_NUM_SMS


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits(num_blocks: int, num_keys: int, sms: int) -> int:
    """Chunks (a power of two, each of at least MIN_KEYS_PER_SPLIT keys) to cut `num_keys` into so that
    `num_blocks` thread blocks per chunk fill `sms` SMs; 1 when one call fills the GPU already."""
    if num_blocks >= sms:
        return 1
    wanted = min(-(-sms // num_blocks), num_keys // MIN_KEYS_PER_SPLIT)
    return 1 << (wanted.bit_length() - 1) if wanted > 1 else 1


def split_attend(attend: Attend4, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H, M, D] attends k/v [H, N, D] (non-causal) in `splits` key chunks (views of k/v; keys not viewable
    as chunks go unsplit); returns out [H, M, D] and lse [H, M] fp32, equal to one unsplit call."""
    heads, n, head_dim = k.shape
    length = -(-n // splits)
    chunks = n // length
    viewable = all(t.stride(-1) == 1 and t.stride(1) == head_dim for t in (k, v))
    if chunks < 2 or not viewable:
        out, lse = attend(q[None], k[None], v[None], scale)
        return out[0].float(), lse[0].float()
    main = chunks * length
    # [H, main, D] -> [H, chunks, L, D] -> [chunks, H, L, D]: chunk j holds keys j*L .. (j+1)*L - 1
    k_main = k[:, :main].view(heads, chunks, length, head_dim).transpose(0, 1)
    v_main = v[:, :main].view(heads, chunks, length, head_dim).transpose(0, 1)
    q_rep = q[None].expand(chunks, *q.shape).contiguous()        # [chunks, H, M, D]
    out, lse = attend(q_rep, k_main, v_main, scale)               # [chunks, H, M, D], [chunks, H, M]
    if main < n:  # the keys past the last whole chunk: one more call, merged with the rest
        tail_out, tail_lse = attend(q[None], k[None, :, main:], v[None, :, main:], scale)
        out, lse = torch.cat([out.float(), tail_out.float()]), torch.cat([lse.float(), tail_lse.float()])
    return merge_stacked(out, lse)

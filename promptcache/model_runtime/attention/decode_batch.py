"""A decode step's attention for every layer as one kernel object (bf16: `attention/csrc/decode_bf16.cpp` on
AVX512-BF16; fp32: `avx2/csrc/decode_f32.cpp` on AVX2): the step's KV is handed over once ([L, H_kv, N, D]), then each
layer is one `attend(q, layer, scale)` call merging in C++ (cheaper than `shared_module_attention`'s per-layer Python
from 4 sequences up in bf16, at every batch in fp32). Prefilling sequences take the general path."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from promptcache.model_runtime import avx2
from promptcache.model_runtime.attention import bf16_kernel

Segment = tuple[torch.Tensor, torch.Tensor, tuple[int, ...], "tuple[int, ...] | None"]


@dataclass(frozen=True, slots=True)
class StepDecode:
    """A step's decoding sequences planned as one `DecodeBatch`. Where the step also prefills: `rows`, the decoding
    ones' query rows in the packed step; `others`, the prefilling ones (general path), their rows (`other_rows`) and the
    segments they see (`other_segments`, members renumbered among `others`). All None / empty when all decode."""

    batch: Any
    rows: torch.Tensor | None = None
    others: tuple[int, ...] = ()
    other_rows: torch.Tensor | None = None
    other_segments: tuple[Segment, ...] = ()


# A step that also prefills splits off its decoding sequences from this many on (below, the general path's
# one batch call for them costs less than the split's gathers and a second planning).
MIN_SPLIT_DECODES = 2


def plan_step_decode(query: torch.Tensor, query_lens: Sequence[int], own_keys: Sequence[torch.Tensor],
                     own_values: Sequence[torch.Tensor], own_lens: Sequence[int], segments: Sequence[Segment],
                     backend: str) -> StepDecode | None:
    """`plan_decode_batch` for the step's decoding sequences (arguments as there), or None where it gives None or
    too few decode beside a prefill."""
    decoding = [i for i, n in enumerate(query_lens) if n == 1]
    if len(decoding) == len(query_lens):
        batch = plan_decode_batch(query, query_lens, own_keys, own_values, own_lens, segments, backend)
        return None if batch is None else StepDecode(batch)
    if len(decoding) < MIN_SPLIT_DECODES:
        return None
    batch = plan_decode_batch(query, [1] * len(decoding), [own_keys[i] for i in decoding],
                              [own_values[i] for i in decoding], [own_lens[i] for i in decoding],
                              restricted(segments, decoding), backend)
    if batch is None:
        return None
    others = tuple(i for i, n in enumerate(query_lens) if n != 1)
    starts = [0, *itertools.accumulate(query_lens)]
    rows = torch.tensor([starts[i] for i in decoding], dtype=torch.long, device=query.device)
    other_rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in others]).to(query.device)
    return StepDecode(batch, rows, others, other_rows, tuple(restricted(segments, others)))


def restricted(segments: Sequence[Segment], seqs: Sequence[int]) -> list[Segment]:
    """The segments as the sequences `seqs` (in that order) see them: members among them renumbered by
    their place in `seqs`, their row offsets kept; a segment none of them sees is left out."""
    number = {seq: j for j, seq in enumerate(seqs)}
    return [(keys, values, tuple(number[members[j]] for j in seen),
             None if offsets is None else tuple(offsets[j] for j in seen))
            for keys, values, members, offsets in segments
            if (seen := [j for j, m in enumerate(members) if m in number])]


def plan_decode_batch(query: torch.Tensor, query_lens: Sequence[int], own_keys: Sequence[torch.Tensor],
                      own_values: Sequence[torch.Tensor], own_lens: Sequence[int], segments: Sequence[Segment],
                      backend: str) -> Any | None:
    """The step's `DecodeBatch`, or None where the kernel does not take it (`kernel_takes`). `query` is one
    layer's [1, H, total_q, D]; own_keys[i] [L, H_kv, capacity, D] holds own_lens[i] keys; segments are
    (keys, values [L, H_kv, n, D], sequences, row offsets or None)."""
    if not kernel_takes(query.dtype, query.device, query.shape[-1], query_lens, backend):
        return None
    # A row offset of 1 or more hides the segment from a sequence whose one row is row 0.
    kept = [(keys, values, seeing) for keys, values, members, offsets in segments
            if keys.shape[2] > 0 and (seeing := [m for j, m in enumerate(members) if not offsets or offsets[j] == 0])]
    return decode_batch_type(query.dtype)(list(own_keys), list(own_values), list(own_lens), [s[0] for s in kept],
                                          [s[1] for s in kept], [s[2] for s in kept])


def decode_batch_type(dtype: torch.dtype) -> Any:
    """The loaded `DecodeBatch` class for KV in `dtype` (bf16 kernel, AVX2 fp32 kernel), or None."""
    if dtype == torch.bfloat16:
        return bf16_kernel.decode_batch_type()
    return avx2.decode_batch_type() if dtype == torch.float32 else None


def kernel_takes(dtype: torch.dtype, device: torch.device, head_dim: int, query_lens: Sequence[int],
                 backend: str) -> bool:
    """Whether a decode kernel takes a step: `auto`, a CPU, a kernel loaded for `dtype` and its head dims, one token
    each."""
    head_dims = bf16_kernel.HEAD_DIMS if dtype == torch.bfloat16 else avx2.DECODE_HEAD_DIMS
    return (backend == "auto" and device.type == "cpu" and head_dim in head_dims
            and all(n == 1 for n in query_lens) and decode_batch_type(dtype) is not None)

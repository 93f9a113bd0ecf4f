"""Exact merge of partial attention results by log-sum-exp rescaling (Hydragen eq. 5)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch


def merge_partials(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> torch.Tensor:
    """Attention over disjoint KV parts merged into attention over their union, in fp32: outs[j] [..., rows, D]
    over part j, lses[j] [..., rows] its scores' log-sum-exp (-inf: no key of that part). Returns [..., rows, D]."""
    assert outs and len(outs) == len(lses)
    if len(outs) == 1:
        return outs[0].float()
    # Few ops (each one a kernel launch on a GPU): no stacking copies, the products summed pairwise.
    lses = [x.float() for x in lses]
    top = functools.reduce(torch.maximum, lses).nan_to_num(neginf=0.0)  # [..., rows]; 0 where no part had a key
    weights = [torch.exp(lse - top) for lse in lses]           # [..., rows] each
    merged, total = weights[0].unsqueeze(-1) * outs[0], weights[0]
    for w, out in zip(weights[1:], outs[1:]):
        merged, total = merged + w.unsqueeze(-1) * out, total + w
    return merged / total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_partials` over a stacked leading dimension (outs [parts, ..., rows, D], lses [parts, ..., rows]),
    also returning the merged lse: fp32 out [..., rows, D], lse [..., rows] (-inf where no part had a key)."""
    lse = lses.float()
    top = lse.amax(dim=0).nan_to_num(neginf=0.0)                         # [..., rows]; 0 where no part had a key
    weights = torch.exp(lse - top)                                       # [parts, ..., rows]
    total = weights.sum(dim=0)                                           # [..., rows]
    merged = (weights.unsqueeze(-1) * outs).sum(dim=0)                   # [..., rows, head_dim] fp32
    merged = merged / total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    return merged, top + torch.log(total)


class RowMerge:
    """Partial results over disjoint KV parts merged by LSE into [Q, H, D] (Hydragen eq. 5); rows no part covers: zeros.
    A part of every row in order (`whole`) is merged once at the end (no running buffers, gathers or scatters where all
    sequences see the same segments); a part of some rows is folded into a running fp32 result."""

    def __init__(self, total_q: int, num_heads: int, head_dim: int, device: torch.device) -> None:
        self.shape, self.device = (total_q, num_heads, head_dim), device
        self.whole: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.acc: tuple[torch.Tensor, torch.Tensor] | None = None  # out [Q, H, D], lse [Q, H] fp32

    def add(self, rows: torch.Tensor | slice, out: torch.Tensor, lse: torch.Tensor, *, whole: bool = False) -> None:
        """out [M, H, D], lse [M, H] of the rows `rows` (all Q rows in order where `whole`)."""
        if whole:
            self.whole.append((out, lse))
            return
        if self.acc is None:
            acc_out = torch.zeros(self.shape, dtype=torch.float32, device=self.device)
            acc_lse = torch.full(self.shape[:2], float("-inf"), dtype=torch.float32, device=self.device)
            acc_out[rows], acc_lse[rows] = out.float(), lse.float()
            self.acc = (acc_out, acc_lse)
            return
        acc_out, acc_lse = self.acc
        old_lse = acc_lse[rows]
        new_lse = torch.logaddexp(old_lse, lse)
        safe = new_lse.nan_to_num(neginf=0.0)  # rows no part has reached yet
        acc_out[rows] = (acc_out[rows] * torch.exp(old_lse - safe).unsqueeze(-1)
                         + out.float() * torch.exp(lse - safe).unsqueeze(-1))
        acc_lse[rows] = new_lse

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        """The merged attention output [Q, H, D] in `dtype`."""
        if self.acc is not None:
            for out, lse in self.whole:
                self.add(slice(None), out, lse)
            return self.acc[0].to(dtype)
        if not self.whole:
            return torch.zeros(self.shape, dtype=dtype, device=self.device)
        return merge_partials([out for out, _ in self.whole], [lse for _, lse in self.whole]).to(dtype)

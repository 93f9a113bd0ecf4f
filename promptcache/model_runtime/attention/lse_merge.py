"""Exact merge of partial attention results by log-sum-exp rescaling (Hydragen eq. 5)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def merge_partials(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> torch.Tensor:
    """Combine attention over disjoint KV parts into attention over their union.

    outs[j]: [..., rows, head_dim] softmax-weighted values over part j; lses[j]: [..., rows] the
    log-sum-exp of part j's scores (-inf where a row saw no key of that part). Computed in fp32;
    returns fp32 [..., rows, head_dim].
    """
    assert outs and len(outs) == len(lses)
    if len(outs) == 1:
        return outs[0].float()
    lse = torch.stack([x.float() for x in lses])              # [parts, ..., rows]
    top = lse.max(dim=0).values                                # [..., rows]
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(lse - top)                             # [parts, ..., rows]
    total = weights.sum(dim=0)                                 # [..., rows]
    merged = sum(w.unsqueeze(-1) * o.float() for w, o in zip(weights, outs))
    return merged / total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_partials` over a stacked leading dimension, also returning the merged lse.

    outs [parts, ..., rows, head_dim], lses [parts, ..., rows] (-inf: a part with no key for that row).
    Returns fp32 out [..., rows, head_dim] and lse [..., rows] (-inf where no part had a key).
    """
    lse = lses.float()
    top = lse.max(dim=0).values                                          # [..., rows]
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(lse - top)                                       # [parts, ..., rows]
    total = weights.sum(dim=0)                                           # [..., rows]
    merged = (weights.unsqueeze(-1) * outs.float()).sum(dim=0)           # [..., rows, head_dim]
    merged = merged / total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    return merged, top + torch.log(total)

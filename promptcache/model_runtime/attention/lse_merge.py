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

"""Oracles for runtime tests: the explicit attention mask that expresses a plan's approximation."""

from __future__ import annotations

import torch

from promptcache.pml import PromptPlan


def approximation_mask(plan: PromptPlan) -> torch.Tensor:
    """[1, 1, n, n] boolean mask over `plan.token_ids()` (position order), True = may attend.

    A cached token attends to the tokens of the segments its KV was encoded after and causally within
    its own segment; a new token attends to every cached token and causally to new tokens.
    """
    positions = plan.position_ids()
    index = {p: i for i, p in enumerate(positions)}
    n = len(positions)
    mask = torch.zeros((n, n), dtype=torch.bool)  # [n, n]
    segments = {c.segment.segment_id: c.segment for c in plan.cached}
    cached_rows = []
    for item in plan.cached:
        seg = item.segment
        context_cols = [index[p] for sid in item.context_ids for p in segments[sid].position_ids]
        rows = [index[p] for p in seg.position_ids]
        cached_rows += rows
        for k, row in enumerate(rows):
            mask[row, context_cols] = True
            mask[row, rows[: k + 1]] = True
    new_rows = [index[p] for run in plan.new_runs for p in range(run.start, run.end)]
    for k, row in enumerate(new_rows):
        mask[row, cached_rows] = True
        mask[row, new_rows[: k + 1]] = True
    return mask[None, None]

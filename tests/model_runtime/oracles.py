"""Oracle for runtime tests: one forward pass whose explicit attention mask expresses a plan's approximation."""

from __future__ import annotations

import torch

from promptcache.model_runtime.engine import Fidelity, ReusePlan, resolve
from promptcache.pml import PromptPlan


def approximation_reference(plan: PromptPlan) -> tuple[list[int], list[int], torch.Tensor]:
    """Tokens, positions and a [1, 1, n, n] mask such that one forward pass computes what the cached
    path computes for `plan` as the paper does (the fast mode): see `reuse_reference`."""
    return reuse_reference(plan, resolve(plan, Fidelity("fast")))


def reuse_reference(plan: PromptPlan, reuse: ReusePlan) -> tuple[list[int], list[int], torch.Tensor]:
    """Tokens, positions and a [1, 1, n, n] mask such that one forward pass computes what the engine
    computes for `reuse` (any fidelity mode) — its last row is the first sampled token's input.

    Rows: every cached segment's stored tokens with the mask they were encoded under (the tokens of
    the segments it was encoded after, causally within itself; context segments outside the plan —
    placeholder tokens of parameter slots — join as extra rows seen only by those), then the stream (the
    tokens the engine computes, in position order). A stream token attends causally to the stream and
    to the reused cached tokens its ReusePlan makes visible: all of them in fast mode, those positioned
    before it in balanced mode (recomputed heads replace their stored versions), the leading segments
    in exact mode (whose stored KV sits at the stream's positions).
    """
    schema = plan.schema
    encoded = {c.segment.segment_id: tuple(c.context_ids) for c in plan.cached}
    pending = [sid for ctx in encoded.values() for sid in ctx if sid not in encoded]
    while pending:
        sid = pending.pop()
        if sid not in encoded:
            encoded[sid] = schema.segments[sid].context_ids
            pending += [c for c in encoded[sid] if c not in encoded]
    tokens, positions, rows_of = [], [], {}
    for sid in encoded:
        segment = schema.segments[sid]
        rows_of[sid] = list(range(len(tokens), len(tokens) + len(segment.token_ids)))
        tokens += segment.token_ids
        positions += list(segment.position_ids)
    stream_rows = list(range(len(tokens), len(tokens) + len(reuse.token_ids)))
    tokens += reuse.token_ids
    positions += reuse.position_ids
    n = len(tokens)
    mask = torch.zeros((n, n), dtype=torch.bool)  # [n, n]
    for sid, context in encoded.items():
        context_cols = [r for c in context for r in rows_of[c]]
        for k, row in enumerate(rows_of[sid]):
            mask[row, context_cols] = True
            mask[row, rows_of[sid][: k + 1]] = True
    for k, row in enumerate(stream_rows):
        for use in reuse.uses:
            if k >= use.visible_from:
                mask[row, rows_of[use.cached.segment.segment_id][use.first: use.last]] = True
        mask[row, stream_rows[: k + 1]] = True
    return tokens, positions, mask[None, None]

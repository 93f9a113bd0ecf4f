"""Oracles for runtime tests: explicit-mask forward passes of a plan's reuse, and the HF greedy loop after them."""

from __future__ import annotations

import torch

from promptcache.model_runtime.engine import Fidelity, ReusePlan, resolve
from promptcache.model_runtime.packed_attention import cache_argument, past_cache
from promptcache.pml import PromptPlan


def approximation_reference(plan: PromptPlan) -> tuple[list[int], list[int], torch.Tensor]:
    """Tokens, positions and a [1, 1, n, n] mask such that one forward pass computes what the cached
    path computes for `plan` as the paper does (the fast mode): see `reuse_reference`."""
    return reuse_reference(plan, resolve(plan, Fidelity("fast")))


def reuse_reference(plan: PromptPlan, reuse: ReusePlan) -> tuple[list[int], list[int], torch.Tensor]:
    """Tokens, positions and mask of `reuse_reference_rows`."""
    tokens, positions, mask, _ = reuse_reference_rows(plan, reuse)
    return tokens, positions, mask


def reuse_reference_rows(plan: PromptPlan, reuse: ReusePlan
                         ) -> tuple[list[int], list[int], torch.Tensor, list[list[int]]]:
    """Tokens, positions and a [1, 1, n, n] mask such that one forward pass computes what the engine
    computes for `reuse` (any fidelity mode) — its last row is the first sampled token's input.

    Rows: every cached segment's stored tokens with the mask they were encoded under (the tokens of
    the segments it was encoded after, as its use in `reuse` names them, causally within itself;
    context segments outside the plan — placeholder tokens of parameter slots, predecessor modules —
    join as extra rows seen only by those), then the stream (the tokens the engine computes, in
    position order). A stream token attends causally to the stream and
    to the reused cached tokens its ReusePlan makes visible: all of them in fast mode, those positioned
    before it in balanced mode (recomputed heads replace their stored versions), the leading segments
    in exact mode (whose stored KV sits at the stream's positions).

    Contiguous positions (`reuse.positions`), derived here from the plan alone: every prompt token's
    position is its rank among the plan's positions. A reused segment moved by s positions is a copy of
    the segment and of everything it was encoded after, all at their positions + s: RoPE sees only
    relative positions, so the copy's hidden states equal the stored ones, and its keys sit where the
    re-aligned request attends them (negative positions included).

    Also returns, per use of `reuse`, the rows of its tokens [first, last).
    """
    schema = plan.schema
    encoded = {c.segment.segment_id: tuple(c.context_ids) for c in plan.cached}
    encoded |= {u.cached.segment.segment_id: tuple(u.cached.context_ids) for u in reuse.uses}  # as reused
    pending = [sid for ctx in encoded.values() for sid in ctx if sid not in encoded]
    while pending:
        sid = pending.pop()
        if sid not in encoded:
            encoded[sid] = schema.segments[sid].context_ids
            pending += [c for c in encoded[sid] if c not in encoded]
    shifts, stream_positions = _positions(plan, reuse)
    tokens: list[int] = []
    positions: list[int] = []
    rows_of: dict[tuple[int, int], list[int]] = {}

    def rows(sid: int, shift: int) -> list[int]:
        if (sid, shift) not in rows_of:
            segment = schema.segments[sid]
            rows_of[(sid, shift)] = list(range(len(tokens), len(tokens) + len(segment.token_ids)))
            tokens.extend(segment.token_ids)
            positions.extend(p + shift for p in segment.position_ids)
            for context in encoded[sid]:
                rows(context, shift)
        return rows_of[(sid, shift)]

    for sid in encoded:
        rows(sid, 0)
    for use, shift in zip(reuse.uses, shifts):
        rows(use.cached.segment.segment_id, shift)
    stream_rows = list(range(len(tokens), len(tokens) + len(reuse.token_ids)))
    tokens += reuse.token_ids
    positions += stream_positions
    n = len(tokens)
    mask = torch.zeros((n, n), dtype=torch.bool)  # [n, n]
    for (sid, shift), own in rows_of.items():
        context_cols = [r for c in encoded[sid] for r in rows_of[(c, shift)]]
        for k, row in enumerate(own):
            mask[row, context_cols] = True
            mask[row, own[: k + 1]] = True
    for k, row in enumerate(stream_rows):
        for use, shift in zip(reuse.uses, shifts):
            if k >= use.visible_from:
                mask[row, rows_of[(use.cached.segment.segment_id, shift)][use.first: use.last]] = True
        mask[row, stream_rows[: k + 1]] = True
    use_rows = [rows_of[(use.cached.segment.segment_id, shift)][use.first: use.last]
                for use, shift in zip(reuse.uses, shifts)]
    return tokens, positions, mask[None, None], use_rows


def _positions(plan: PromptPlan, reuse: ReusePlan) -> tuple[list[int], list[int]]:
    """(shift of each use, positions of the stream) for `reuse`: the engine's own stream positions and
    no shift at the layout's positions; computed from the plan when re-aligned."""
    if reuse.positions == "layout":
        return [0] * len(reuse.uses), list(reuse.position_ids)
    layout = sorted(plan.position_ids())
    rank = {p: i for i, p in enumerate(layout)}
    covered = {p for u in reuse.uses for p in u.cached.segment.position_ids[u.first: u.last]}
    stream = [p for p in layout if p not in covered]
    assert len(stream) == len(reuse.token_ids), "the stream is every prompt token no use covers"
    starts = [u.cached.segment.position_ids[u.first] for u in reuse.uses]
    return [rank[p] - p for p in starts], [rank[p] for p in stream]


@torch.inference_mode()
def reference_greedy(loaded, plan: PromptPlan, params, fidelity: Fidelity | None = None) -> tuple[list[int], str]:
    """The engine's greedy tokens for `plan` and their finish reason ("stop" or "length"), computed by
    plain HF transformers: one forward pass with the explicit mask of `reuse_reference_rows`, then
    token-by-token decoding with the model's own KV cache, each generated token attending to what the
    engine's do (every reused module token, the stream, the tokens generated before it).

    `params` (a greedy SamplingParams) gives `max_tokens` and `ignore_eos`; like the engine, decoding
    also ends with "length" when the next token's position would be past the model's. The fidelity mode
    is the engine's default (fast, layout positions) unless given.
    """
    assert params.temperature == 0, "the oracle is greedy (every one of n samples gets its tokens)"
    model = loaded.model
    reuse = resolve(plan, fidelity or Fidelity(), can_shift=loaded.key_shifter is not None)
    tokens, positions, mask, use_rows = reuse_reference_rows(plan, reuse)
    n, num_stream = len(tokens), len(reuse.token_ids)
    # Generated tokens see every reused module token and the stream, never the extra context rows.
    visible = torch.zeros((1, n), dtype=torch.long)  # [1, kv_len]
    visible[0, n - num_stream:] = 1
    for rows in use_rows:
        visible[0, rows] = 1
    next_position = max(p for p, seen in zip(positions, visible[0].tolist()) if seen) + 1
    device = model.device
    out = model(input_ids=torch.tensor([tokens], device=device), position_ids=torch.tensor([positions], device=device),
                attention_mask=mask.to(device), use_cache=True)
    eos = () if params.ignore_eos else tuple(loaded.eos_token_ids)
    generated: list[int] = []
    while True:
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        if token in eos:
            return generated, "stop"
        if len(generated) >= params.max_tokens or next_position >= loaded.max_positions:
            return generated, "length"
        visible = torch.cat([visible, torch.ones((1, 1), dtype=torch.long)], dim=1)
        out = model(input_ids=torch.tensor([[token]], device=device),
                    position_ids=torch.tensor([[next_position]], device=device), attention_mask=visible.to(device),
                    use_cache=True, **cache_argument(model, past_cache(out)))
        next_position += 1


def reference_tokens(loaded, plan: PromptPlan, params, fidelity: Fidelity | None = None) -> list[int]:
    """The tokens of `reference_greedy`."""
    return reference_greedy(loaded, plan, params, fidelity)[0]


def reference_text(loaded, token_ids: list[int]) -> str:
    """The text the engine streams for greedy `token_ids`: an end-of-sequence token adds none."""
    eos = set(loaded.eos_token_ids)
    return loaded.tokenizer.decode([t for t in token_ids if t not in eos], skip_special_tokens=True)

"""The sampling processors as [B, V] tensor ops over a step's rows, each row with its own parameters (Hugging Face's
order and arithmetic: logit bias, repetition penalty, presence/frequency penalties, temperature, top-k, top-p, min-p).
A row whose parameter is neutral (bias 0, penalty 1 or 0, temperature 1, no cut) comes out bit-equal: x * 1, x / 1
and x - 0 are exact, and a neutral cut masks nothing. No op here reads a value back to the host."""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def add_bias(scores: torch.Tensor, flat_ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`scores` [B, V] plus `values` [N] at flat positions `flat_ids` [N] (row * V + token id)."""
    return scores.reshape(-1).index_add(0, flat_ids, values).view_as(scores)


def penalise(scores: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor | None,
             repetition: torch.Tensor | None, presence: torch.Tensor, frequency: torch.Tensor,
             has_counts_terms: bool) -> torch.Tensor:
    """`scores` [B, V] with the penalties applied to `rows` [P]: `counts` [P, V] float32 generated-token counts,
    `prompt_seen` [P, V] bool (the prompt's ids, for the repetition penalty), per-row `repetition` (None: all 1),
    `presence`, `frequency` [P]. HF's repetition penalty covers every id seen once; OpenAI's penalties the
    generated ones, by count."""
    sub = scores.index_select(0, rows)  # [P, V]
    if repetition is not None:
        seen = counts > 0  # [P, V] bool
        if prompt_seen is not None:
            seen = seen | prompt_seen
        penalty = repetition[:, None]  # [P, 1]
        sub = torch.where(seen, torch.where(sub < 0, sub * penalty, sub / penalty), sub)
    if has_counts_terms:
        sub = sub - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()
    return scores.index_copy(0, rows, sub)


def divide(scores: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """`scores` [B, V] / per-row `temperature` [B] (1 where a row keeps its scores)."""
    return scores / temperature[:, None]


def top_k(scores: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keep each row's `k` [B] largest scores (0: all; at most V), ties with the k-th included; `max_k` = max(k)."""
    values = torch.topk(scores, max_k, dim=-1).values                              # [B, max_k], descending
    kth = values.gather(1, (k - 1).clamp(min=0)[:, None])                          # [B, 1]
    kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, NEG_INF))
    return scores.masked_fill(scores < kth, NEG_INF)


def top_p(scores: torch.Tensor, drop_mass: torch.Tensor) -> torch.Tensor:
    """HF's top-p: drop each row's lowest tokens whose total probability is at most `drop_mass` [B] (1 - top_p;
    negative: drop none); the most likely token always stays."""
    ascending, order = torch.sort(scores, dim=-1)                                  # [B, V] each
    drop = torch.softmax(ascending, dim=-1).cumsum(dim=-1) <= drop_mass[:, None]   # [B, V] bool
    drop[:, -1] = False
    return scores.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), NEG_INF)


def min_p(scores: torch.Tensor, fraction: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than `fraction` [B] (0: none) times their row's most likely token."""
    probs = torch.softmax(scores, dim=-1)                                          # [B, V]
    return scores.masked_fill(probs < fraction[:, None] * probs.amax(dim=-1, keepdim=True), NEG_INF)


CDF_BLOCK = 1024  # tokens per block of draw_by_cdf's two-level search


def draw_by_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [S, V] given `uniform` [S] in [0, 1): the token whose interval of the cumulative
    probability holds uniform x the row's total (inverse-CDF sampling), never a token of probability 0.
    Two levels, so no op runs a scan over the vocabulary (a [S, V] cumsum is a scalar loop on a CPU): the blocks of
    CDF_BLOCK tokens are summed and scanned, then only the chosen block. One uniform a row where the exponential race
    draws V exponentials (262K of them, a Gemma 3 row, took ~7 ms on a CPU core). Returns [S] int64."""
    rows, vocab = probs.shape
    padded = torch.nn.functional.pad(probs, (0, -vocab % CDF_BLOCK)) if vocab % CDF_BLOCK else probs
    blocks = padded.view(rows, -1, CDF_BLOCK)                                      # [S, nb, block]
    # Block sums in the probabilities' dtype (a float64 sum would first copy the whole [S, V] to float64), scanned
    # in float64.
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)                         # [S, nb], non-decreasing
    total = block_cdf[:, -1:]                                                      # [S, 1]
    # uniform x total can round up to total itself: the largest double below it still falls in a live token.
    target = torch.minimum(uniform.double()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=blocks.shape[1] - 1)  # [S, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), 0.0)       # [S, 1]
    share = (target - before) / (block_cdf.gather(1, block) - before)             # [S, 1], in [0, 1]
    chosen = blocks.gather(1, block[:, :, None].expand(rows, 1, CDF_BLOCK))[:, 0]   # [S, block]
    inner = chosen.double().cumsum(dim=-1)                                         # [S, block]
    # The same share of the block's own scan, kept below its end: its scan need not end exactly at its sum above.
    end = inner[:, -1:]
    index = torch.searchsorted(inner, torch.minimum(share * end, torch.nextafter(end, torch.zeros_like(end))),
                               right=True)                                         # [S, 1]
    return (block * CDF_BLOCK + index)[:, 0].clamp_(max=vocab - 1)


def draw(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [S, V] given Exp(1) `noise` [S, V]: argmax(p / q) is what torch.multinomial
    computes for one sample (the exponential race), so a generator's draws pick today's tokens. Returns [S] int64."""
    return (probs / noise).argmax(dim=-1)

"""A step's tokens picked for all its rows at once: per-row parameters copied to the device in one transfer
(StepInputs), the processors as [B, V] ops, greedy rows by argmax, unseeded sampled rows by inverse CDF, seeded ones by
the exponential race on their own generators, and the tokens, the non-finite flags and the asked-for logprobs read
back in one device-to-host copy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from promptcache.model_runtime.attention.step_indices import to_device
from promptcache.model_runtime.sampling import processors
from promptcache.model_runtime.sampling.params import TokenLogprobs
from promptcache.model_runtime.sampling.step_inputs import StepInputs

if TYPE_CHECKING:
    from promptcache.model_runtime.sampling.state import Sampler

NON_FINITE = "the sampling distribution is not finite (non-finite logits)"


@dataclass(frozen=True, slots=True)
class Draw:
    """One row's pick: its token (recorded in its sampler's history), its logprobs when asked for, or the error
    that fails its request alone (a non-finite distribution, a logit_bias id outside the vocabulary)."""

    token_id: int
    logprobs: TokenLogprobs | None = None
    error: Exception | None = None


def sample_batch(samplers: Sequence[Sampler], logits: torch.Tensor, rows: Sequence[int] | None = None) -> list[Draw]:
    """Pick one token for each sampler from `logits` [N, V] float32 (row rows[b] for samplers[b]; None: row b);
    records each pick in its sampler. One host-to-device copy (the parameters) and one device-to-host copy (the
    picks) per call; seeded rows draw from their own generator, so a pick never depends on the other rows."""
    if not samplers:
        return []
    inputs = StepInputs.build(samplers, logits.shape[-1], rows, logits.device)
    packed = draw_on_device(inputs, logits)
    return read_draws(inputs, packed.tolist())  # the step's one device-to-host copy


def batch_scores(samplers: Sequence[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """The scores [B, V] float32 (-inf: excluded) the rows of `logits` [B, V] are picked from (plain greedy: the
    logits); adds recorded tokens to the samplers' counts, records nothing."""
    inputs = StepInputs.build(samplers, logits.shape[-1], None, logits.device)
    return _scores(inputs, _base(inputs, logits))


def draw_on_device(inputs: StepInputs, logits: torch.Tensor) -> torch.Tensor:
    """float64 [B + S + R + 2 * R * max_top]: the B tokens, the S sampled rows' non-finite flags, the R logprob
    rows' chosen logprobs, then their top ids and top logprobs ([R, max_top] each, flattened). Reads nothing back."""
    base = _base(inputs, logits)                                                     # [B, V] float32
    scores = _scores(inputs, base)
    tokens = None if inputs.is_all_sampled else scores.argmax(dim=-1)               # [B] greedy picks
    pieces = []
    if inputs.sampled:
        sampled = inputs.pack.ints("sampled")
        sub = scores if inputs.is_all_sampled else scores.index_select(0, sampled)   # [S, V]
        probs = torch.softmax(sub, dim=-1)
        # Flag, never check here: a host check per row would stall the step; the host fails those rows. Softmax's
        # outputs lie in [0, 1] or are NaN, so a row's sum is finite exactly when all of it is (one pass, not four).
        pieces.append((~torch.isfinite(probs.sum(dim=-1))).double())                # [S]
        picks = _draw(inputs, probs)
        tokens = picks if tokens is None else tokens.index_copy(0, sampled, picks)
    assert tokens is not None, "a step whose every row is sampled has picks"
    pieces.insert(0, tokens.double())
    if inputs.logprob_rows:
        which = inputs.pack.ints("logprob_rows")
        logprobs = torch.log_softmax(base.index_select(0, which), dim=-1)            # [R, V] of the raw logits
        pieces.append(logprobs.gather(1, tokens.index_select(0, which)[:, None]).reshape(-1).double())  # [R]
        if inputs.max_top:
            top = torch.topk(logprobs, inputs.max_top, dim=-1)                       # [R, max_top] each
            pieces += [top.indices.reshape(-1).double(), top.values.reshape(-1).double()]
    return torch.cat(pieces)


def read_draws(inputs: StepInputs, values: list[float]) -> list[Draw]:
    """The host's half: `values` (draw_on_device's tensor as a list) turned into Draws, picks recorded."""
    num_rows, num_sampled, num_logprobs = len(inputs.samplers), len(inputs.sampled), len(inputs.logprob_rows)
    tokens = [int(t) for t in values[:num_rows]]
    errors: dict[int, Exception] = dict(inputs.errors)
    for row, flag in zip(inputs.sampled, values[num_rows: num_rows + num_sampled]):
        if flag and row not in errors:
            errors[row] = FloatingPointError(NON_FINITE)
    found: dict[int, TokenLogprobs] = {}
    start, k = num_rows + num_sampled, inputs.max_top
    for i, row in enumerate(inputs.logprob_rows):
        top_ids = values[start + num_logprobs + i * k: start + num_logprobs + (i + 1) * k]
        top_values = values[start + num_logprobs * (1 + k) + i * k: start + num_logprobs * (1 + k) + (i + 1) * k]
        num_top = inputs.samplers[row].params.logprobs or 0
        found[row] = TokenLogprobs(values[start + i], tuple(zip(map(int, top_ids[:num_top]), top_values[:num_top])))
    draws = []
    for row, (sampler, token) in enumerate(zip(inputs.samplers, tokens)):
        error = errors.get(row)
        if error is None:
            sampler.record(token)
        draws.append(Draw(token, found.get(row), error))
    return draws


def _base(inputs: StepInputs, logits: torch.Tensor) -> torch.Tensor:
    """[B, V] float32: each row's logits (gathered when rows repeat or skip, as n samples of one prompt do)."""
    base = logits if inputs.rows is None else logits.index_select(0, inputs.pack.ints("rows"))
    return base.float()


def _scores(inputs: StepInputs, base: torch.Tensor) -> torch.Tensor:
    """The processors in SamplingParams' order; each runs only when some row of the step uses it."""
    pack, scores = inputs.pack, base
    if inputs.has_bias:
        scores = processors.add_bias(scores, pack.ints("bias_at"), pack.floats("bias"))
    if inputs.penalised:
        scores = processors.penalise(
            scores, pack.ints("penalised"), inputs.counts(), inputs.prompt_seen(),
            pack.floats("repetition") if inputs.has_repetition else None,
            pack.floats("presence"), pack.floats("frequency"), inputs.has_counts_terms)
    if inputs.has_temperature:
        scores = processors.divide(scores, pack.floats("temperature"))
    if inputs.max_k:
        scores = processors.top_k(scores, pack.ints("top_k"), inputs.max_k)
    if inputs.has_top_p:
        scores = processors.top_p(scores, pack.floats("top_p_drop"))
    if inputs.has_min_p:
        scores = processors.min_p(scores, pack.floats("min_p"))
    return scores


def _draw(inputs: StepInputs, probs: torch.Tensor) -> torch.Tensor:
    """One token per sampled row of `probs` [S, V]: unseeded rows by inverse CDF on one float64 uniform each from the
    device's default generator (one op for all of them); each seeded row by the exponential race on its own generator,
    Exp(1) noise [V] drawn as torch.multinomial's own buffer would, so a seed picks what it picked before. [S] int64."""
    generators = [inputs.samplers[row].generator(probs.device) for row in inputs.sampled]
    if any(g is None for g in generators):  # every row drawn so; seeded rows' picks are replaced below
        picks = processors.draw_by_cdf(probs, torch.rand(probs.shape[0], dtype=torch.float64, device=probs.device))
    else:
        picks = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)        # [S]
    for i, generator in enumerate(generators):
        if generator is not None:
            noise = torch.empty_like(probs[i]).exponential_(generator=generator)       # [V]
            picks[i] = processors.draw(probs[i: i + 1], noise[None])[0]
    return picks


def batch_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: int) -> list[TokenLogprobs]:
    """`logits` [R, V]: each row's log-softmax at token_ids[r] and its `num_top` largest, read back in one copy."""
    if not token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)                             # [R, V]
    ids = to_device(torch.tensor(list(token_ids), dtype=torch.long), logits.device)  # [R]
    top = torch.topk(logprobs, num_top, dim=-1)                                      # [R, num_top] each
    packed = torch.cat([logprobs.gather(1, ids[:, None]).double(), top.indices.double(), top.values.double()], dim=1)
    return [TokenLogprobs(row[0], tuple(zip(map(int, row[1: 1 + num_top]), row[1 + num_top:])))
            for row in packed.tolist()]


def token_logprobs(logits: torch.Tensor, token: int, num_top: int) -> TokenLogprobs:
    """`logits`: [vocab]. The log-softmax of the raw logits at `token` and its `num_top` largest."""
    return batch_logprobs(logits.unsqueeze(0), [token], num_top)[0]

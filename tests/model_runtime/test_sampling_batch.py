"""The batched sampler against the per-sequence sampler it replaced (tests/model_runtime/sampling_reference.py):
the same scores bit for bit, the same tokens for greedy and seeded rows over several steps with penalties, the same
logprobs; unseeded rows drawn from the right distribution; a row's picks independent of the rest of the batch;
non-finite rows failed alone, as before."""

from __future__ import annotations

import random

import pytest
import torch

from promptcache.model_runtime.sampling import (
    PromptTokens,
    Sampler,
    SamplingParams,
    batch_scores,
    processors,
    sample_batch,
)
from tests.model_runtime.sampling_reference import ReferenceSampler, reference_logprobs

VOCAB = 300

# One feature each (greedy and seeded), then mixes: every parameter the engine supports.
FEATURES = [
    dict(temperature=0), dict(temperature=0.7, seed=1), dict(temperature=1.0, top_k=5, seed=2),
    dict(temperature=1.3, top_k=VOCAB + 7, seed=3), dict(temperature=0.9, top_p=0.8, seed=4),
    dict(temperature=1.0, min_p=0.2, seed=5), dict(temperature=0, repetition_penalty=1.4),
    dict(temperature=0.8, repetition_penalty=0.7, seed=6), dict(temperature=0, presence_penalty=1.5),
    dict(temperature=1.0, frequency_penalty=-0.8, seed=7), dict(temperature=0, logit_bias=((4, 30.0), (9, -50.0))),
    dict(temperature=1.0, logit_bias=((4, 3.0),), seed=8), dict(temperature=1.0, top_k=1, presence_penalty=0.5),
    dict(temperature=0, logprobs=3), dict(temperature=1.0, seed=9, logprobs=0),
    dict(temperature=1.1, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.3,
         frequency_penalty=0.4, logit_bias=((7, 2.0),), seed=10, logprobs=5),
]


def _random_params(rng: random.Random) -> SamplingParams:
    spec: dict = dict(temperature=rng.choice([0, 0.5, 1.0, 1.3]))
    for name, values in [("top_k", [1, 3, 50]), ("top_p", [0.3, 0.95]), ("min_p", [0.05, 0.3]),
                         ("repetition_penalty", [0.8, 1.3]), ("presence_penalty", [-1.0, 1.7]),
                         ("frequency_penalty", [-0.6, 2.0]), ("seed", range(100)), ("logprobs", [0, 2, 20])]:
        if rng.random() < 0.35:
            spec[name] = rng.choice(values)
    if rng.random() < 0.3:
        spec["logit_bias"] = tuple((t, rng.uniform(-100, 100)) for t in rng.sample(range(VOCAB), 3))
    if not spec["temperature"] or spec.get("top_k") == 1:
        spec.setdefault("seed", None)
    elif "seed" not in spec:
        spec["seed"] = rng.randrange(100)  # unseeded draws have no reference to equal: tested by distribution
    return SamplingParams(**spec)


def _check_steps(params: list[SamplingParams], num_steps: int, seed: int) -> None:
    """Batched vs one reference sampler per row over `num_steps` steps of fresh logits: scores, tokens, logprobs."""
    prompt = PromptTokens([1, 2, 3, 11, 200])
    ours = [Sampler(p, seed_offset=i, prompt=prompt) for i, p in enumerate(params)]
    theirs = [ReferenceSampler(p, seed_offset=i, prompt=prompt) for i, p in enumerate(params)]
    g = torch.Generator().manual_seed(seed)
    for step in range(num_steps):
        logits = torch.randn(len(params), VOCAB, generator=g) * 3  # [B, vocab]
        scores = batch_scores(ours, logits)
        draws = sample_batch(ours, logits)
        for b, (p, reference, draw) in enumerate(zip(params, theirs, draws)):
            if not p.is_plain_greedy:
                assert torch.equal(scores[b], reference.scores(logits[b])), (step, b, p)
            token = reference.take(int(logits[b].argmax())) if p.is_plain_greedy else reference.sample(logits[b])
            assert (draw.token_id, draw.error) == (token, None), (step, b, p)
            if p.logprobs is not None:
                assert draw.logprobs is not None
                assert (draw.logprobs.logprob, draw.logprobs.top) == reference_logprobs(logits[b], token, p.logprobs)
            else:
                assert draw.logprobs is None


@pytest.mark.parametrize("spec", FEATURES, ids=lambda s: ",".join(s))
def test_each_parameter_alone_equals_the_per_sequence_sampler(spec):
    _check_steps([SamplingParams(**spec)], num_steps=5, seed=1)


def test_every_parameter_in_one_batch_equals_the_per_sequence_sampler():
    _check_steps([SamplingParams(**spec) for spec in FEATURES], num_steps=6, seed=2)


@pytest.mark.parametrize("seed", range(12))
def test_random_batches_equal_the_per_sequence_sampler(seed):
    rng = random.Random(seed)
    _check_steps([_random_params(rng) for _ in range(rng.randint(1, 9))], num_steps=4, seed=seed)


def test_a_seeded_row_picks_the_same_tokens_alone_and_in_any_batch():
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, presence_penalty=0.4)
    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(VOCAB, generator=g) for _ in range(6)]

    def picks(num_before: int, num_after: int) -> list[int]:
        other = SamplingParams(temperature=1.0, frequency_penalty=0.5)
        others = [Sampler(other) for _ in range(num_before + num_after)]
        samplers = [*others[:num_before], Sampler(params), *others[num_before:]]
        noise = torch.Generator().manual_seed(num_before * 7 + num_after)
        tokens = []
        for logits in steps:
            rows = torch.randn(len(samplers), VOCAB, generator=noise)
            rows[num_before] = logits
            tokens.append(sample_batch(samplers, rows)[num_before].token_id)
        return tokens

    alone = picks(0, 0)
    assert picks(3, 0) == alone and picks(0, 5) == alone and picks(2, 4) == alone
    assert picks(0, 0) != [Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=43)).sample(x) for x in steps]


def test_unseeded_rows_follow_the_processed_distribution():
    """No reference draws exist for unseeded rows: their frequencies must match softmax(scores) (the reference's
    scores), each row its own, in one batch with greedy and seeded rows."""
    torch.manual_seed(0)
    vocab, num_draws = 12, 6000
    logits = torch.randn(3, vocab) * 1.5  # [rows, vocab]
    params = [SamplingParams(temperature=0.8, top_k=6), SamplingParams(temperature=1.2, min_p=0.1, top_p=0.9),
              SamplingParams(temperature=1.0, repetition_penalty=1.5)]
    extra = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)]
    # One step of num_draws copies of each row (fresh samplers: no history), greedy and seeded rows among them.
    which = [b for b in range(3) for _ in range(num_draws)] + [0, 1]
    samplers = [Sampler(p, prompt=PromptTokens([0, 1])) for p in [*(params[b] for b in which[:-2]), *extra]]
    draws = sample_batch(samplers, logits, which)
    counts = torch.zeros(3, vocab)
    for b, draw in zip(which[:-2], draws):
        counts[b, draw.token_id] += 1
    for b, p in enumerate(params):
        expected = torch.softmax(ReferenceSampler(p, prompt=PromptTokens([0, 1])).scores(logits[b]), dim=-1)
        observed = counts[b] / num_draws
        assert torch.all(observed[expected == 0] == 0), p  # never a token the processors cut
        # Binomial standard error at 6000 draws is at most 0.0065: 5 of them.
        assert torch.allclose(observed, expected, atol=0.033), (p, observed, expected)


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_non_finite_rows_fail_alone_as_before(bad):
    """A sampled row whose distribution is not finite gets FloatingPointError (the reference raises it too); a
    greedy row takes the argmax as before; the other rows are unaffected."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[1] = bad                                  # all NaN or all -inf: softmax is NaN
    logits[2, 5] = float("nan")                      # one NaN: greedy's argmax picks it, as torch.argmax does
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=2),
              SamplingParams(temperature=0), SamplingParams(temperature=0.5, seed=4)]
    draws = sample_batch([Sampler(p) for p in params], logits)
    with pytest.raises(FloatingPointError):
        ReferenceSampler(params[1]).sample(logits[1])
    assert isinstance(draws[1].error, FloatingPointError)
    assert draws[2].error is None and draws[2].token_id == ReferenceSampler(params[2]).sample(logits[2]) == 5
    for b in (0, 3):
        assert draws[b].error is None and draws[b].token_id == ReferenceSampler(params[b]).sample(logits[b])


def test_a_bias_outside_the_vocabulary_fails_its_row_only():
    params = [SamplingParams(temperature=0, logit_bias=((VOCAB + 3, 1.0),)), SamplingParams(temperature=0)]
    logits = torch.randn(2, VOCAB)
    draws = sample_batch([Sampler(p) for p in params], logits)
    assert isinstance(draws[0].error, IndexError) and "logit_bias" in str(draws[0].error)
    assert draws[1].error is None and draws[1].token_id == int(logits[1].argmax())


def test_forked_rows_read_their_logits_row_and_keep_their_own_counts():
    """n samples of one prompt read the same logits row (`rows`), each with its own seed offset and counts."""
    params = SamplingParams(temperature=1.0, seed=5, frequency_penalty=1.0, n=3)
    prompt_logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))  # row 1: the prompt's
    ours = [Sampler(params, seed_offset=i) for i in range(3)]
    theirs = [ReferenceSampler(params, seed_offset=i) for i in range(3)]
    draws = sample_batch(ours, prompt_logits, [1, 1, 1])
    assert [d.token_id for d in draws] == [r.sample(prompt_logits[1]) for r in theirs]
    step = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    assert [d.token_id for d in sample_batch(ours, step)] == [r.sample(row) for r, row in zip(theirs, step)]


def test_inverse_cdf_picks_the_token_whose_interval_holds_the_uniform():
    """draw_by_cdf against the intervals by hand: token i owns [cdf[i-1], cdf[i]); a token of probability 0 owns none,
    at either end too, and a uniform just below 1 (whose product with the total rounds up to it) lands in the last
    live token."""
    probs = torch.tensor([[0.0, 0.25, 0.25, 0.0, 0.5, 0.0]] * 6)                   # [6, 6]
    uniform = torch.tensor([0.0, 0.24, 0.25, 0.5, 0.75, 1.0 - 2.0 ** -53], dtype=torch.float64)
    assert processors.draw_by_cdf(probs, uniform).tolist() == [1, 1, 2, 4, 4, 4]
    unnormalised = torch.tensor([[3.0, 0.0, 1.0]] * 3)  # a total other than 1 scales the intervals
    assert processors.draw_by_cdf(unnormalised, torch.tensor([0.7, 0.75, 0.99])).tolist() == [0, 2, 2]
    # Three blocks (the last one padded): mass at a block's last token, inside the next, past a block of zeros.
    block = processors.CDF_BLOCK
    spread = torch.zeros(5, 2 * block + 5)
    spread[:, [block - 1, block + 476, 2 * block + 2]] = torch.tensor([0.25, 0.25, 0.5])
    uniform = torch.tensor([0.0, 0.2499, 0.25, 0.5, 1.0 - 2.0 ** -53], dtype=torch.float64)
    assert processors.draw_by_cdf(spread, uniform).tolist() == [block - 1, block - 1, block + 476, 2 * block + 2,
                                                                2 * block + 2]


def test_unseeded_rows_of_a_large_vocabulary_follow_their_distribution():
    """A 262,144-token row (Gemma 3's vocabulary) with its mass on a few hundred tokens: 1,000 unseeded draws (10 steps
    of 100 rows), their frequencies per mass bucket against the softmax (binomial standard errors), none outside it."""
    torch.manual_seed(1)
    vocab, rows, steps = 262_144, 100, 10
    logits = torch.full((1, vocab), -1e4)
    live = torch.randperm(vocab)[:300]
    logits[0, live] = torch.randn(300) * 2
    tokens = torch.tensor([d.token_id for _ in range(steps)
                           for d in sample_batch([Sampler(SamplingParams(temperature=1.0)) for _ in range(rows)],
                                                 logits, [0] * rows)])
    probs = torch.softmax(logits[0], dim=-1)
    assert bool(torch.isin(tokens, live).all())
    order = live[probs[live].argsort(descending=True)]
    for bucket in (order[:3], order[3:20], order[20:]):  # the likeliest tokens, the middle, the tail
        expected = float(probs[bucket].sum())
        observed = float(torch.isin(tokens, bucket).float().mean())
        error = (expected * (1 - expected) / tokens.numel()) ** 0.5
        assert abs(observed - expected) <= 5 * error + 1e-9, (observed, expected)

"""StepBudget: the prefill tokens a step may feed while streams decode, learned from step times."""

from __future__ import annotations

import pytest

from promptcache.model_runtime.engine import EngineConfig
from promptcache.model_runtime.engine.step_budget import StepBudget


def test_the_budget_keeps_a_simulated_step_within_the_slowdown():
    decode_ms, token_ms = 100.0, 10.0  # a machine where a prefill token costs a tenth of a decode step
    budget = StepBudget(min_tokens=1, max_tokens=256, max_slowdown=1.6)
    assert budget.tokens() == 1  # nothing measured: start small
    for _ in range(30):
        budget.observe(4, 0, decode_ms)
        n = budget.tokens()
        budget.observe(4, n, decode_ms + n * token_ms)
    assert budget.tokens() == 6  # 0.6 decode steps of tokens at 10 ms each
    assert decode_ms + budget.tokens() * token_ms <= 1.6 * decode_ms


@pytest.mark.parametrize(("token_ms", "expected"), [(1e-4, 64), (500.0, 8)])
def test_the_budget_stays_within_its_bounds(token_ms, expected):
    budget = StepBudget(min_tokens=8, max_tokens=64, max_slowdown=2.0)
    budget.observe(2, 0, 50.0)
    for _ in range(10):
        n = budget.tokens()
        budget.observe(2, n, 50.0 + n * token_ms)
    assert budget.tokens() == expected


def test_one_noisy_step_neither_jumps_the_budget_nor_outweighs_the_big_steps():
    budget = StepBudget(min_tokens=8, max_tokens=4096, max_slowdown=1.6)
    budget.observe(4, 0, 150.0)
    budget.observe(4, 8, 140.0)  # timing noise: the chunk looked free
    assert budget.tokens() == 16  # at most double what was measured, not 4096
    for _ in range(20):
        n = budget.tokens()
        budget.observe(4, n, 150.0 + 4.0 * n)  # 4 ms a token
    settled = budget.tokens()
    budget.observe(4, 1, 100.0)  # a one-token step that happened to be fast
    assert settled == 22 and budget.tokens() >= settled - 2


def test_steps_without_decoding_teach_nothing_and_no_slowdown_means_fixed_chunks():
    budget = StepBudget(min_tokens=4, max_tokens=32, max_slowdown=1.5)
    budget.observe(0, 4096, 9000.0)  # a prefill alone: no stream waited
    assert budget.decode_ms is None and budget.token_ms is None and budget.tokens() == 4
    assert StepBudget(min_tokens=4, max_tokens=32, max_slowdown=None).tokens() == 32


def test_engine_config_rejects_a_slowdown_that_allows_no_prefill():
    with pytest.raises(ValueError, match="max_step_slowdown"):
        EngineConfig(max_step_slowdown=1.0)


def test_more_sequences_waiting_than_decoding_buy_a_larger_step():
    decode_ms, token_ms = 100.0, 10.0
    budget = StepBudget(min_tokens=1, max_tokens=256, max_slowdown=1.6)
    for _ in range(30):
        budget.observe(4, 0, decode_ms)
        n = budget.tokens()
        budget.observe(4, n, decode_ms + n * token_ms)
    assert budget.tokens(0.5) == budget.tokens() == 6  # fewer waiting than decoding: the slowdown as set
    # 12 waiting behind 3 decoding: four times the slowdown's share, within the doubling guard's 4x.
    assert budget.tokens(4.0) == 24
    assert decode_ms + budget.tokens(4.0) * token_ms <= (1 + 0.6 * 4) * decode_ms


def _burst_ttfts(target_ms: float | None) -> list[float]:
    """First-token times (ms) of 10 questions of 14 tokens arriving together while 6 streams decode, on
    a simulated machine: a decode step 32 ms plus 1.2 ms a prompt token, questions fed in order."""
    decode_ms, token_ms = 32.0, 1.2
    budget = StepBudget(min_tokens=8, max_tokens=256, max_slowdown=1.6, ttft_target_ms=target_ms)
    for _ in range(30):  # learned from the steady state before the burst
        budget.observe(6, 0, decode_ms)
        n = budget.tokens()
        budget.observe(6, n, decode_ms + n * token_ms)
    left, clock, ttfts = [14] * 10, 0.0, []
    while left:
        allowed, fed, done = budget.tokens(len(left) / 6, [(clock, n) for n in left]), 0, 0
        while left and fed < allowed:
            take = min(left[0], allowed - fed)
            fed, left[0] = fed + take, left[0] - take
            if left[0] == 0:
                left.pop(0)
                done += 1
        clock += decode_ms + fed * token_ms
        ttfts += [clock] * done  # the questions finished by this step get their first token when it ends
    return ttfts


def test_a_ttft_target_feeds_a_burst_of_questions_that_would_be_late_in_one_step():
    learned, targeted = _burst_ttfts(None), _burst_ttfts(300.0)
    assert max(learned) > 300.0  # at the learned budget the last question waits several steps
    assert max(targeted) <= 300.0 and len(set(targeted)) == 1  # all in one step, within the target
    assert sum(targeted) < sum(learned)  # and the burst's mean TTFT is lower too


def test_a_ttft_target_leaves_the_budget_alone_while_every_question_is_on_time():
    budget = StepBudget(min_tokens=8, max_tokens=256, max_slowdown=1.6, ttft_target_ms=300.0)
    for _ in range(30):
        budget.observe(6, 0, 32.0)
        n = budget.tokens()
        budget.observe(6, n, 32.0 + 1.2 * n)
    assert budget.tokens(1 / 6, [(0.0, 14)]) == budget.tokens(1 / 6)
    assert budget.tokens(1 / 6, [(290.0, 100)]) == 100  # one that is about to be late is fed whole
    with pytest.raises(ValueError, match="ttft_target_ms"):
        EngineConfig(ttft_target_ms=0)

"""StepBudget: how many prompt or encoding tokens a step may feed while other sequences decode.

A step that also feeds prefill tokens delays every stream's next token by the tokens' compute. A fixed
chunk size cannot bound that delay: the cost of a token against the cost of a decode step differs by
machine, dtype, model and batch (on a 2-core CPU a 64-token chunk tripled the gap; on a GPU it is
almost free). So the budget is learned online: the engine reports each step's duration, and the budget
is the number of tokens whose measured marginal cost keeps a step within `max_slowdown` times a
decode-only step — never below `min_tokens` (a long prompt must still progress), never above
`max_tokens`. With a `ttft_target_ms`, a step also feeds every prompt that would otherwise get its
first token after that target (at the learned budget and step cost), with the prompts queued before it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

_SMOOTHING = 0.2  # weight of the newest measurement in the moving averages


@dataclass(slots=True)
class StepBudget:
    """Prefill tokens per step while sequences decode. Used only on the engine thread.

    `max_slowdown` None turns learning off: the budget is always `max_tokens`.
    """

    min_tokens: int
    max_tokens: int
    max_slowdown: float | None
    ttft_target_ms: float | None = None
    decode_ms: float | None = None  # moving average of a decode-only step
    added_ms: float | None = None   # moving average of what prefill tokens added to a mixed step
    fed: float | None = None        # moving average of the prefill tokens of a mixed step

    @property
    def token_ms(self) -> float | None:
        """One prefill token's added cost: a ratio of averages, so a step that fed one token (whose
        cost is lost in the noise) weighs little."""
        if self.added_ms is None or not self.fed:
            return None
        return max(self.added_ms / self.fed, 1e-3)

    def tokens(self, waiting_per_decoding: float = 0.0, queue: Sequence[tuple[float, int]] = ()) -> int:
        """The budget for the next step that has decoding sequences. `waiting_per_decoding`: sequences
        waiting for their first token per decoding one. Above 1 the allowed slowdown grows with it: the
        step's delay then falls on few streams while its tokens serve many (16 requests arriving
        together behind a few decodes got one question a step: the last waited ~17 steps).
        `queue`: (ms waited, prompt tokens left) of each sequence waiting for its first token, in the
        order the step feeds them."""
        learned = self._learned(waiting_per_decoding)
        return max(learned, self._due(learned, queue))

    def _learned(self, waiting_per_decoding: float) -> int:
        if self.max_slowdown is None:
            return self.max_tokens
        token_ms = self.token_ms
        if self.decode_ms is None or token_ms is None:
            return self.min_tokens  # nothing measured yet: start small, learn from it
        pressure = max(1.0, waiting_per_decoding)
        allowed = int((self.max_slowdown - 1.0) * pressure * self.decode_ms / token_ms)
        # At most double the chunks measured so far: one noisy step must not buy a huge chunk.
        allowed = min(allowed, int(2 * pressure * max(self.fed or 0, self.min_tokens)))
        return max(self.min_tokens, min(self.max_tokens, allowed))

    def _due(self, budget: int, queue: Sequence[tuple[float, int]]) -> int:
        """The prompt tokens to feed now so that no queued prompt, fed `budget` tokens a step behind the
        ones before it, gets its first token after `ttft_target_ms`: all tokens up to the last prompt
        that would be late. A burst of questions then gets one longer step instead of a dozen short ones
        behind each other (each short step also pays a whole decode step)."""
        token_ms = self.token_ms
        if self.ttft_target_ms is None or self.decode_ms is None or token_ms is None or not queue:
            return 0
        step_ms = self.decode_ms + budget * token_ms  # a mixed step at the learned budget
        due = queued = 0
        for waited_ms, left in queue:
            queued += left
            if waited_ms + math.ceil(queued / budget) * step_ms > self.ttft_target_ms:
                due = queued
        return min(due, self.max_tokens)

    def observe(self, num_decoding: int, num_prefill_tokens: int, step_ms: float) -> None:
        """Account one step that ran `num_decoding` decode tokens and `num_prefill_tokens` others."""
        if num_decoding == 0:
            return  # nothing decoded: no stream waited, nothing to learn about the trade
        if num_prefill_tokens == 0:
            self.decode_ms = moving_average(self.decode_ms, step_ms)
        elif self.decode_ms is not None:
            self.added_ms = moving_average(self.added_ms, step_ms - self.decode_ms)
            self.fed = moving_average(self.fed, num_prefill_tokens)


def moving_average(current: float | None, sample: float) -> float:
    """`current` moved a `_SMOOTHING` share toward `sample` (`sample` when nothing was measured yet)."""
    return sample if current is None else (1 - _SMOOTHING) * current + _SMOOTHING * sample

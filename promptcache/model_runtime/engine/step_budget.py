"""Step sizes learned online from step times (token and decode costs differ by machine, dtype, model and batch by 100x).
StepBudget: tokens a step may feed beside decodes within `max_slowdown` times a decode-only step (a fixed 64-token chunk
tripled the gap on a 2-core CPU), plus, with a `ttft_target_ms`, every prompt that would get its first token later
(and those queued before it). SharedStepCap: rows a step may run while tenants share the engine, so a light tenant's
first token waits about twice its time alone; feedback on rows, as no cost model fits while a flood keeps the mix
constant."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

_SMOOTHING = 0.2  # weight of the newest measurement in the moving averages
_MAX_ROWS = 4096


@dataclass(slots=True)
class StepBudget:
    """Prefill tokens a step may feed while sequences decode (`max_slowdown` None: always `max_tokens`)."""

    min_tokens: int
    max_tokens: int
    max_slowdown: float | None
    ttft_target_ms: float | None = None
    decode_ms: float | None = None  # moving average of a decode-only step
    added_ms: float | None = None   # moving average of what prefill tokens added to a mixed step
    fed: float | None = None        # moving average of the prefill tokens of a mixed step

    @property
    def token_ms(self) -> float | None:
        """A prefill token's added cost, a ratio of averages (a one-token step, lost in noise, weighs little)."""
        if self.added_ms is None or not self.fed:
            return None
        return max(self.added_ms / self.fed, 1e-3)

    def tokens(self, waiting_per_decoding: float = 0.0, queue: Sequence[tuple[float, int]] = ()) -> int:
        """The budget of the next step with decodes. Above one waiting sequence per decoding one
        (`waiting_per_decoding`), the slowdown allowed grows with it: the delay falls on few streams, the tokens serve
        many. `queue`: (ms waited, prompt tokens left) of each sequence waiting for its first token, fed in order."""
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


@dataclass(slots=True)
class SharedStepCap:
    """Rows a step may run while tenants share the engine: others' steps held to `ratio` times a light one's."""

    ratio: float
    min_rows: int  # a step may always run this many rows (a prompt chunk beside a decode, so nothing starves)
    light_ms: float | None = None  # moving average of a light tenant's step of its own
    rows: float = 64.0  # the cap, adjusted after every capped step

    def cap(self) -> int | None:
        """The cap for the next shared step; None until a light step was measured."""
        return None if self.light_ms is None else int(self.rows)

    def observe_light(self, step_ms: float) -> None:
        """Account a light tenant's step of its own."""
        self.light_ms = moving_average(self.light_ms, step_ms)

    def observe_capped(self, rows: int, step_ms: float) -> None:
        """Account a capped step that ran `rows` rows in `step_ms`: the cap moves toward the rows that would have
        taken the target time (at most 20 % a step), growing only when the cap, not the work, bounded the step."""
        if self.light_ms is None or rows == 0:
            return
        target = self.ratio * self.light_ms
        scale = min(max(target / max(step_ms, 1e-3), 0.8), 1.2)
        if scale < 1.0 or rows >= 0.9 * self.rows:
            self.rows = min(max(self.rows * scale, float(self.min_rows)), float(_MAX_ROWS))

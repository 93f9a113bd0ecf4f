"""SharedStepCap: how many rows (decodes plus prompt tokens) a step may run while several tenants share
the engine, learned from step times.

A tenant's first token waits for the step in flight when its prompt arrives, then for a step of its
own (step_plan.compose_step gives a light tenant one). So its time to first token is at most twice
its time alone if no step of the others lasts longer than that step of its own. The cap holds the
others' steps to `ratio` times the light steps measured, by feedback on the rows a step may run: a
cost model (ms per decode, per prompt token, fixed) cannot be fitted while a flood keeps the step's
mix constant, and the rows-to-milliseconds ratio differs by machine, dtype and model by 100x.
"""

from __future__ import annotations

from dataclasses import dataclass

from promptcache.model_runtime.engine.step_budget import moving_average

_MAX_ROWS = 4096


@dataclass(slots=True)
class SharedStepCap:
    """Rows per step while tenants share the engine. Used only on the engine thread."""

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
        """Account a step composed under the cap that ran `rows` rows in `step_ms`: the cap moves toward
        the rows that would have taken the target time (at most 20 % a step, so one noisy step
        cannot swing it), and grows only when the cap, not the work available, bounded the step."""
        if self.light_ms is None or rows == 0:
            return
        target = self.ratio * self.light_ms
        scale = min(max(target / max(step_ms, 1e-3), 0.8), 1.2)
        if scale < 1.0 or rows >= 0.9 * self.rows:
            self.rows = min(max(self.rows * scale, float(self.min_rows)), float(_MAX_ROWS))

"""SharedStepCap: the rows a busy tenant's step may run while a light tenant is served, learned from
step times against a simulated machine."""

from __future__ import annotations

import pytest

from promptcache.model_runtime.engine.step_budget import SharedStepCap


def _simulate(cap: SharedStepCap, fixed_ms: float, row_ms: float, steps: int, work: int = 10_000) -> list[float]:
    """Steps of min(cap, work) rows costing fixed + rows * row_ms; their durations."""
    durations = []
    for _ in range(steps):
        limit = cap.cap()
        assert limit is not None
        rows = min(limit, work)
        durations.append(fixed_ms + rows * row_ms)
        cap.observe_capped(rows, durations[-1])
    return durations


def test_no_cap_before_a_light_step_was_measured():
    cap = SharedStepCap(ratio=1.0, min_rows=9)
    cap.observe_capped(64, 500.0)
    assert cap.cap() is None


@pytest.mark.parametrize(("fixed_ms", "row_ms"), [(12.0, 0.8), (2.0, 0.01)])  # a 2-core CPU; a GPU-like machine
def test_steps_converge_to_the_light_steps_length(fixed_ms, row_ms):
    cap = SharedStepCap(ratio=1.0, min_rows=9)
    light_ms = fixed_ms + 17 * row_ms * 2  # a light tenant's prompt of 34 tokens
    cap.observe_light(light_ms)
    durations = _simulate(cap, fixed_ms, row_ms, steps=60)
    assert durations[-1] == pytest.approx(light_ms, rel=0.1)


def test_the_cap_stops_at_its_floor_when_even_a_small_step_is_longer_than_the_target():
    cap = SharedStepCap(ratio=1.0, min_rows=9)
    cap.observe_light(10.0)
    _simulate(cap, fixed_ms=30.0, row_ms=1.0, steps=40)
    assert cap.cap() == 9


def test_the_cap_grows_only_when_it_bounded_the_step():
    cap = SharedStepCap(ratio=1.0, min_rows=9)
    cap.observe_light(100.0)
    _simulate(cap, fixed_ms=10.0, row_ms=0.1, steps=20, work=20)  # little work: steps far under the target
    assert cap.cap() == 64  # unchanged: the work, not the cap, bounded them
    _simulate(cap, fixed_ms=10.0, row_ms=0.1, steps=20)
    assert cap.cap() > 64

"""Fixtures of the model-runtime tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def engines():
    """`engines(factory, **kwargs)` builds a test harness holding an `.engine`; every engine built is
    stopped after the test."""
    made = []

    def make(factory, **kwargs):
        made.append(factory(**kwargs))
        return made[-1]

    yield make
    for harness in made:
        harness.engine.stop()

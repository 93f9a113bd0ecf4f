"""Fixtures of the model-runtime tests."""

from __future__ import annotations

import shutil

import pytest

from promptcache.model_runtime.attention import bf16_kernel


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


@pytest.fixture(scope="session")
def bf16_kernels() -> None:
    """Builds (or loads) the AVX512-BF16 kernels; skips without a C++ compiler, fails if the CPU has the
    instructions and a compiler but the build fails (tests using it are skipped on other CPUs)."""
    if not bf16_kernel.prepare():
        if shutil.which("c++") is None and shutil.which("g++") is None:
            pytest.skip("no C++ compiler to build the kernels")
        pytest.fail("the bf16 kernels did not build on a CPU that supports them (see the log)")

"""Fixtures of the model-runtime tests."""

from __future__ import annotations

import pytest

from promptcache.model_runtime.attention import bf16_kernel, kernel_build


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
    """Builds the AVX512-BF16 kernels as `promptcache build-kernels` does (once per torch and sources) and
    loads them; skips where they cannot be built (no compiler), fails if they can but the build or the load
    fails (tests using it are skipped on CPUs without the instructions)."""
    try:
        kernel_build.build()
    except kernel_build.KernelBuildError as error:
        if kernel_build.compiler_missing() is not None:
            pytest.skip(f"the bf16 kernels cannot be built here: {error}")
        pytest.fail(f"the bf16 kernels did not build with a compiler present: {error}")
    if bf16_kernel.loaded() is None:
        bf16_kernel._state.clear()  # an earlier prepare() ran before the library existed
        if not bf16_kernel.prepare():
            pytest.fail(f"the built bf16 kernels did not load: {bf16_kernel.unavailable_reason()}")

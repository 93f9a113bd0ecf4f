"""Fixtures of the model-runtime tests."""

from __future__ import annotations

import pytest

from promptcache.model_runtime import avx2, deterministic
from promptcache.model_runtime.attention import bf16_kernel, kernel_build
from promptcache.model_runtime.deterministic import kernels as deterministic_library


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


@pytest.fixture(scope="session")
def deterministic_kernels() -> None:
    """Builds the batch-invariant kernels as `promptcache build-kernels` does and loads them; skips on a CPU without
    AVX2/FMA or where they cannot be built (no compiler), fails if they can but the build or the load fails."""
    if not deterministic.supported():
        pytest.skip("this CPU lacks AVX2 or FMA: no batch-invariant kernels")
    try:
        kernel_build.build(library=deterministic.LIBRARY)
    except kernel_build.KernelBuildError as error:
        if kernel_build.compiler_missing() is not None:
            pytest.skip(f"the batch-invariant kernels cannot be built here: {error}")
        pytest.fail(f"the batch-invariant kernels did not build with a compiler present: {error}")
    if deterministic.prepare() is None:
        deterministic_library.KERNELS.reset()  # an earlier prepare() ran before the library existed
        if deterministic.prepare() is None:
            pytest.fail(f"the built batch-invariant kernels did not load: {deterministic.unavailable_reason()}")


@pytest.fixture(scope="session")
def avx2_kernels() -> None:
    """Builds the AVX2 fp32 kernels as `promptcache build-kernels` does and loads them; skips on a CPU without AVX2, FMA
    and F16C or where they cannot be built (no compiler), fails if they can but the build or the load fails."""
    if not avx2.KERNELS.supported():
        pytest.skip("this CPU lacks AVX2, FMA or F16C: no AVX2 fp32 kernels")
    try:
        kernel_build.build(library=avx2.LIBRARY)
    except kernel_build.KernelBuildError as error:
        if kernel_build.compiler_missing() is not None:
            pytest.skip(f"the AVX2 fp32 kernels cannot be built here: {error}")
        pytest.fail(f"the AVX2 fp32 kernels did not build with a compiler present: {error}")
    if avx2.KERNELS.prepare() is None:
        avx2.KERNELS.reset()  # an earlier prepare() ran before the library existed
        if avx2.KERNELS.prepare() is None:
            pytest.fail(f"the built AVX2 fp32 kernels did not load: {avx2.KERNELS.unavailable_reason()}")

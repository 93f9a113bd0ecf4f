"""Shared fixtures: tiny random-weight runtimes over the in-process test tokenizer."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, wrap_model
from tests import numeric_paths
from tests.model_factories import make_test_tokenizer, make_tiny_model

# Tests compare against fp32 oracles, so the servers they start (in process or as subprocesses, which
# inherit this) run fp32 on every machine; `--dtype auto` would pick bf16 on AMX/avx512_bf16 CPUs. bf16
# has its own tolerance-based tests (tests/model_runtime/test_dtype.py).
os.environ.setdefault("PROMPTCACHE_DTYPE", "float32")
# Unless a rerun names another numeric path for them (tests/numeric_paths.py: scripts/test.sh reruns the docs test
# and the end-to-end tests under each path this machine can take).
if (NUMERIC_PATH := numeric_paths.selected()) is not None:
    os.environ.update(NUMERIC_PATH.env)

# The device of the tiny-model runtimes and their stores: `PROMPTCACHE_TEST_DEVICE=cuda` runs the
# model-runtime, engine and store tests that build them on a GPU (scripts/gpu_check.sh does).
TEST_DEVICE = os.environ.get("PROMPTCACHE_TEST_DEVICE", "cpu")


@functools.cache
def _tiny_loaded(arch: str, dtype: torch.dtype, pack_weights: bool = False, device: str = TEST_DEVICE):
    tokenizer = make_test_tokenizer()
    model = make_tiny_model(arch, vocab_size=len(tokenizer), dtype=dtype).to(device)
    return wrap_model(model, tokenizer, name=f"tiny-{arch}", pack_weights=pack_weights)


def make_tiny_runtime(arch: str = "llama", *, dtype: torch.dtype = torch.float32, store=None,
                      pack_weights: bool = False, device: str = TEST_DEVICE) -> ModelRuntime:
    """A runtime over a cached tiny model on `device` and a fresh in-memory store (unless one is
    given); `pack_weights` as the server loads models (loading/packed_linear.py, CPU only)."""
    store = store if store is not None else build_store(StoreConfig(), device=device)
    return ModelRuntime(_tiny_loaded(arch, dtype, pack_weights and device == "cpu", device), store)


@pytest.fixture
def tiny_runtime():
    return make_tiny_runtime


@pytest.fixture(scope="session")
def smollm2():
    """The real default model (SmolLM2-135M-Instruct, fp32 or the rerun's numeric path's dtype), loaded once per
    session."""
    from promptcache.model_runtime import ModelConfig, load_model

    return load_model(ModelConfig(dtype=NUMERIC_PATH.dtype if NUMERIC_PATH is not None else "float32"))


@pytest.fixture
def redis_server(tmp_path):
    """A fresh real Redis for one test; `redis_server.url`, `.stop()`, `.start()`."""
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path).start()
    yield server
    server.stop()

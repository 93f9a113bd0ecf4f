"""The device tier's budget: as set, else 1 GiB on a CPU (a GPU's share of free memory: test_cuda.py)."""

from __future__ import annotations

import pytest

from promptcache.cache_store import StoreConfig, build_store
from promptcache.cache_store.config import DEFAULT_DEVICE_MAX_BYTES, device_budget


def test_a_set_budget_is_kept_and_an_unset_one_is_the_cpu_default():
    assert build_store(StoreConfig(device_max_bytes=12345)).tiers[0].max_bytes == 12345
    assert build_store(StoreConfig()).tiers[0].max_bytes == DEFAULT_DEVICE_MAX_BYTES
    assert device_budget(None, "cpu") == DEFAULT_DEVICE_MAX_BYTES == 1 << 30


def test_a_non_positive_budget_is_refused():
    with pytest.raises(ValueError, match="device_max_bytes"):
        StoreConfig(device_max_bytes=0)

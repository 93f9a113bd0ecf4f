"""A replica that finds a windowed model's modules in the shared tier (Redis) fetches, for its sliding-window layers,
only the tokens the request's queries still reach: its generations equal Hugging Face's forward, every fidelity
mode's first-token logits equal those of a replica that holds the same modules whole, and it reads fewer bytes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import promptcache.cache_store.block_format as block_format
from promptcache.cache_store import RedisTier, StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, wrap_model
from promptcache.model_runtime.engine import Fidelity
from tests.model_factories import make_test_tokenizer
from tests.model_runtime.batched_generation import assert_batched_generation_equals_hf
from tests.model_runtime.engine_probe import first_step
from tests.model_runtime.test_fidelity import PROMPTS, SCHEMA
from tests.model_runtime.test_sliding_window import _config, _model

MODES = [Fidelity("exact"), Fidelity("fast"), Fidelity("fast", positions="contiguous"), Fidelity("balanced", 2)]


def _replicas(arch: str, url: str):
    """(a replica that encoded the schema and holds its modules whole, a fresh one over the same Redis, the HF twin)."""
    served = _model(_config(arch))
    oracle = AutoModelForCausalLM.from_config(served.config, attn_implementation="sdpa").eval()
    oracle.load_state_dict(served.state_dict())
    loaded = wrap_model(served, make_test_tokenizer(), name=f"tiny-{arch}-window-fetch")
    config = StoreConfig(redis_url=url, redis_namespace=arch)
    encoder = ModelRuntime(loaded, build_store(config))
    encoder.add_schema(encoder.parse_schema(SCHEMA))
    assert encoder.store.flush(30)
    fresh = ModelRuntime(loaded, build_store(config))
    fresh.add_schema(fresh.parse_schema(SCHEMA))
    assert fresh.module_encoder.num_encoded_segments == 0  # every module comes from Redis
    return encoder, fresh, oracle


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_a_fresh_replica_reads_only_the_window_s_reach_and_serves_as_hf(arch, redis_server, monkeypatch):
    monkeypatch.setattr(block_format, "CHUNK_TOKENS", 4)  # modules of ~15 tokens, a window of 8
    whole, fresh, oracle = _replicas(arch, redis_server.url)
    redis = fresh.store.tiers[-1]
    assert isinstance(redis, RedisTier)
    assert_batched_generation_equals_hf(fresh, oracle, PROMPTS, num_tokens=12, fidelity=MODES[0])
    device = fresh.store.tiers[0]
    held = [device.get(key) for key in device.keys()]  # noqa: SIM118  # a tier, not a dict
    parts = [block for block in held if block is not None and block.present is not None]
    assert parts, "no module was fetched in part"
    assert any(t == block.num_tokens for block in parts for t in block.present.first_tokens)  # a layer read nothing
    assert redis.bytes_read < redis.used_bytes  # each module read once, less than its whole value
    for prompt in PROMPTS:
        for mode in MODES:
            plan = whole.plan(prompt)
            want, _ = first_step(whole, plan, mode)
            got, _ = first_step(fresh, fresh.plan(prompt), mode)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{prompt} {mode}")

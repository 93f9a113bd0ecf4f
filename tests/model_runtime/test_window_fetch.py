"""A replica that finds a windowed model's modules in the shared tier (Redis) fetches, for its sliding-window layers,
only the tokens the request's queries still reach (and, encoding a module after others, only what its tokens reach of
them): its generations equal Hugging Face's forward, every fidelity mode's first-token logits equal those of a replica
that holds the same modules whole, and it reads fewer bytes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import promptcache.cache_store.block_format as block_format
from promptcache.cache_store import BlockIndex, BlockIndexConfig, RedisTier, StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, SamplingParams, wrap_model
from promptcache.model_runtime.baseline import full_prefill_greedy, full_prefill_logits
from promptcache.model_runtime.engine import Fidelity
from promptcache.model_runtime.engine.prefix import PrefixReuse
from promptcache.pml import token_plan
from tests.model_factories import make_test_tokenizer
from tests.model_runtime.batched_generation import assert_batched_generation_equals_hf
from tests.model_runtime.engine_probe import engine_tokens, first_step
from tests.model_runtime.test_fidelity import PROMPTS, SCHEMA
from tests.model_runtime.test_sliding_window import _config, _model

# The last encodes each module after the one before it: that encoding fetches its context link in part too.
MODES = [Fidelity("exact"), Fidelity("fast"), Fidelity("fast", positions="contiguous"), Fidelity("balanced", 2),
         Fidelity("fast", context="predecessor")]


def _replicas(arch: str, url: str):
    """(a replica that encodes and holds every module whole, with no shared tier; a fresh one that finds them in Redis,
    written by a third; the HF twin)."""
    served = _model(_config(arch))
    oracle = AutoModelForCausalLM.from_config(served.config, attn_implementation="sdpa").eval()
    oracle.load_state_dict(served.state_dict())
    loaded = wrap_model(served, make_test_tokenizer(), name=f"tiny-{arch}-window-fetch")
    config = StoreConfig(redis_url=url, redis_namespace=arch)
    writer = ModelRuntime(loaded, build_store(config))
    writer.add_schema(writer.parse_schema(SCHEMA))
    assert writer.store.flush(30)
    whole = ModelRuntime(loaded, build_store(StoreConfig()))
    whole.add_schema(whole.parse_schema(SCHEMA))
    fresh = ModelRuntime(loaded, build_store(config))
    fresh.store.policy.margin = 0.0  # always fetch: a tiny model recomputes a module faster than Redis returns it
    fresh.add_schema(fresh.parse_schema(SCHEMA))
    assert fresh.module_encoder.num_encoded_segments == 0  # every module comes from Redis
    return whole, fresh, oracle


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
    assert fresh.module_encoder.num_encoded_segments > 0  # second encodings, over context links read in part


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_prefix_blocks_from_redis_are_read_in_part_and_serve_as_hf(arch, redis_server, monkeypatch):
    """A plain prompt's prefix blocks, stored by one replica, reused by a fresh one: the blocks a window no longer
    reaches are fetched without their local layers, and the first token's logits and the greedy tokens are HF's."""
    monkeypatch.setattr(block_format, "CHUNK_TOKENS", 4)
    _, fresh, oracle = _replicas(arch, redis_server.url)
    writer = ModelRuntime(fresh.loaded, build_store(StoreConfig(redis_url=redis_server.url, redis_namespace=arch)))
    for runtime in (writer, fresh):
        runtime.add_schema(runtime.parse_schema('<schema name="plain"/>'), encode=False)
    vocab = fresh.loaded.model.config.vocab_size
    ids = tuple(torch.randint(3, vocab, (70,), generator=torch.Generator().manual_seed(1)).tolist())
    params, config = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), BlockIndexConfig(block_size=8)
    engine_tokens(writer, token_plan(writer.get_schema("plain"), ids[:60]), params, prefix=config)
    assert writer.store.flush(30)
    loaded = fresh.loaded
    prefix = PrefixReuse(BlockIndex(fresh.store, config, model_fingerprint=loaded.model_fingerprint,
                                    tokenizer_fingerprint=loaded.tokenizer_fingerprint,
                                    bytes_per_token=loaded.kv_bytes_per_token, windows=loaded.layer_windows))
    # A longer prompt (the match ends before its new tokens: parts widened to what they reach), then the same one (the
    # match covers all but its last token: parts as first guessed), each from Redis.
    for n in (70, 60):
        for tier in fresh.store.tiers[:2]:
            for key in tier.keys():  # noqa: SIM118  # a tier, not a dict
                tier.delete(key)
        plan = token_plan(fresh.get_schema("plain"), ids[:n])
        logits, event = first_step(fresh, plan, prefix=prefix)
        assert event.report is not None and event.report.cache is not None
        want = full_prefill_logits(oracle, list(ids[:n]), list(range(n)))[-1]
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4, msg=str(n))
    device = fresh.store.tiers[0]
    held = [device.get(key) for key in device.keys()]  # noqa: SIM118  # a tier, not a dict
    assert any(b is not None and b.present is not None and b.num_tokens == 8 for b in held), "no block read in part"
    got = engine_tokens(fresh, token_plan(fresh.get_schema("plain"), ids), params, prefix=config)
    assert got == full_prefill_greedy(oracle, list(ids), list(range(len(ids))), 6)

"""The one mapping from ServerSettings to the model, store, engine and PML configs (server/settings.py): each
setting reaches the config field it names, and the server builds its store, engine and PML limits from that
mapping alone (the CLI's `encode` and the cluster replicas call the same methods)."""

from __future__ import annotations

import httpx
import pytest
from pydantic import ValidationError

from promptcache.cli import main as cli_main
from promptcache.server.service import PromptService
from promptcache.server.settings import ServerSettings
from tests.model_factories import make_tiny_loaded
from tests.server.test_api import SCHEMA

SETTINGS = dict(model="/models/m", dtype="bfloat16", device="cpu", model_cache_dir="/cache", pack_weights=False,
                fuse_layers=False, device_max_bytes=3 << 20, host_max_bytes=5 << 20, redis_url="redis://h:1/2",
                redis_max_bytes=7 << 20, namespace="ns", redis_timeout_s=1.5, disk_dir="/kv", disk_max_bytes=9 << 20,
                blob_key="k" * 16, max_num_seqs=12, max_kv_bytes=11 << 20, attention_backend="matmul",
                prefix_block_size=16, prefix_ttl_s=30.0, fidelity="balanced", fidelity_head_tokens=8,
                fidelity_positions="layout", fidelity_context="schema", max_prefill_tokens=128,
                max_prefill_tokens_alone=1024, min_prefill_tokens=4, max_step_slowdown=2.0,
                logits_cache_bytes=1 << 20, max_assembled_kv_bytes=2 << 20, max_waiting_per_tenant=5,
                tenant_headroom_seqs=20, tenant_kv_share=0.25, api_keys_file="/keys.json", max_schema_bytes=1000,
                max_request_bytes=2000)


def test_every_setting_reaches_the_config_field_it_names():
    settings = ServerSettings(**SETTINGS)
    model, store = settings.load_config(), settings.store_config({"alpha": 0.5})
    engine, limits = settings.engine_config(), settings.pml_limits()
    assert (model.name_or_path, model.dtype, model.device, model.cache_dir, model.pack_weights,
            model.fuse_layers) == ("/models/m", "bfloat16", "cpu", "/cache", False, False)
    assert (store.device_max_bytes, store.host_max_bytes, store.redis_url, store.redis_max_bytes,
            store.redis_namespace, store.redis_timeout_s, store.disk_dir, store.disk_max_bytes, store.blob_key,
            store.owner_shares) == (3 << 20, 5 << 20, "redis://h:1/2", 7 << 20, "ns", 1.5, "/kv", 9 << 20,
                                    b"k" * 16, (("alpha", 0.5),))
    assert (engine.max_num_seqs, engine.max_kv_bytes, engine.attention_backend, engine.max_prefill_tokens,
            engine.max_prefill_tokens_alone, engine.min_prefill_tokens, engine.max_step_slowdown,
            engine.logits_cache_bytes, engine.max_assembled_bytes, engine.max_waiting_per_tenant) == \
        (12, 11 << 20, "matmul", 128, 1024, 4, 2.0, 1 << 20, 2 << 20, 5)
    assert engine.prefix is not None and (engine.prefix.block_size, engine.prefix.ttl_s) == (16, 30.0)
    fidelity = engine.fidelity
    assert (fidelity.mode, fidelity.head_tokens, fidelity.positions, fidelity.context) == \
        ("balanced", 8, "layout", "schema")
    assert engine.tenant_headroom_seqs == 11  # capped below max_num_seqs: a tenant always gets one slot
    assert engine.tenant_kv_share == 0.25
    assert ServerSettings(**{**SETTINGS, "tenant_kv_share": 0}).engine_config().tenant_kv_share is None  # 0: off
    without_tenants = ServerSettings(**{**SETTINGS, "api_keys_file": None}).engine_config()
    assert (without_tenants.tenant_headroom_seqs, without_tenants.tenant_kv_share) == (0, None)  # one tenant
    assert (limits.max_schema_bytes, limits.max_prompt_bytes) == (1000, 2000)


@pytest.mark.parametrize("value", [",", " , ", ",,,"])
def test_an_api_key_list_with_no_key_is_refused_naming_the_variable(monkeypatch, value):
    """A key list that parses to no key was an open server; it is an error at startup."""
    monkeypatch.setenv("PROMPTCACHE_API_KEYS", value)
    with pytest.raises(ValidationError, match=r"PROMPTCACHE_API_KEYS=.* lists no API key"):
        ServerSettings()
    monkeypatch.setenv("PROMPTCACHE_API_KEYS", " k1 , ,k2,")
    assert ServerSettings().api_keys == ["k1", "k2"]
    monkeypatch.setenv("PROMPTCACHE_API_KEYS", "")  # set but empty: no keys asked for
    assert ServerSettings().api_keys == []


def test_settings_that_turn_things_off_map_to_off():
    settings = ServerSettings(prefix_caching=False, max_step_slowdown=0, tenant_headroom_seqs=8)
    engine = settings.engine_config()
    assert engine.prefix is None and engine.max_step_slowdown is None
    assert engine.tenant_headroom_seqs == 0  # one tenant (no API keys file): no one to keep slots for
    assert settings.store_config().blob_key is None


def test_deterministic_reaches_the_model_config_from_flag_and_environment(monkeypatch, capsys):
    assert ServerSettings(deterministic=True).load_config().deterministic
    assert not ServerSettings().load_config().deterministic
    monkeypatch.setenv("PROMPTCACHE_DETERMINISTIC", "1")
    assert ServerSettings().load_config().deterministic
    monkeypatch.delenv("PROMPTCACHE_DETERMINISTIC")
    # A combination it cannot serve is a startup error naming it, before any model is loaded.
    assert cli_main(["serve", "--deterministic", "--device", "cuda"]) == 2
    assert "deterministic serving cannot run here: it runs on the CPU only" in capsys.readouterr().err
    assert cli_main(["serve", "--deterministic", "--weights", "int8"]) == 2
    assert "not int8" in capsys.readouterr().err


def test_the_server_builds_its_engine_store_and_limits_from_the_mapping():
    settings = ServerSettings(max_num_seqs=6, max_kv_bytes=32 << 20, prefix_block_size=8, device_max_bytes=2 << 20,
                              host_max_bytes=3 << 20, max_schema_bytes=4000, fidelity="balanced",
                              fidelity_head_tokens=4, preload_examples=False)
    service = PromptService(settings, make_tiny_loaded("llama"))
    try:
        assert service.runtime.engine.config == settings.engine_config()
        assert service.runtime.model.limits == settings.pml_limits()
        assert [(t.name, t.max_bytes) for t in service.store.tiers] == [("device", 2 << 20), ("host", 3 << 20)]
        assert service.fidelity(None) == settings.default_fidelity()  # requests that name no mode
    finally:
        service.close()


def test_a_served_limit_is_the_settings_limit(live_server):
    """Over HTTP: a schema one byte over `max_schema_bytes` is refused, one at it is taken."""
    server = live_server(max_schema_bytes=len(SCHEMA.encode()))
    assert httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).status_code == 201
    bigger = SCHEMA.replace('name="docs"', 'name="docs2"')
    refused = httpx.post(server.url + "/v1/schemas", json={"pml": bigger}, timeout=60)
    assert refused.status_code == 413 and refused.json()["error"]["type"] == "pml_limit_exceeded", refused.text

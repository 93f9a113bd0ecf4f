"""Where a schema upload puts the module KV it encodes (`upload_kv_local`), seen through /metrics and
the responses' cache reports of the real server."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.test_api import PROMPT, SCHEMA


def _bytes_by_kind(url: str) -> dict[tuple[str, str], float]:
    families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    family = next(f for f in families if f.name == "promptcache:cache_usage_by_kind_bytes")
    return {(s.labels["tier"], s.labels["kind"]): s.value for s in family.samples}


def _generate(url: str) -> dict:
    response = httpx.post(url + "/v1/generate", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    response.raise_for_status()
    return response.json()


def test_an_upload_for_other_replicas_leaves_the_device_tier_to_what_this_one_serves(live_server, tmp_path):
    local = live_server(disk_dir=str(tmp_path / "local"))
    remote = live_server(disk_dir=str(tmp_path / "remote"), upload_kv_local=False)
    for server in (local, remote):
        httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
        server.app.state.service.store.flush(10)
    kept, shared = _bytes_by_kind(local.url), _bytes_by_kind(remote.url)
    assert kept[("device", "module")] > 0 and kept[("disk", "module")] > 0
    assert shared[("device", "module")] == 0 and shared[("disk", "module")] == kept[("disk", "module")]
    # The first prompt over it reads the modules from the shared tier, then from the device tier; the
    # answers are the ones the local encoding gives.
    oracle = _generate(local.url)
    first, second = _generate(remote.url), _generate(remote.url)
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == oracle["choices"][0]["text"]
    assert {m["tier"] for m in oracle["cache"]["modules"]} == {"device"}
    assert {m["tier"] for m in first["cache"]["modules"]} == {"disk"}
    assert {m["tier"] for m in second["cache"]["modules"]} == {"device"}

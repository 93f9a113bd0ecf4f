"""Schema quotas reserved before encoding (server/quota.py): concurrent uploads over HTTP against one server
and two servers sharing a real Redis, releases on failure and delete, the ledger's lease and pruning on a
real Redis, and listings and quota checks that read only the caller's schema documents."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time

import httpx
import pytest
import redis

from promptcache.server.quota import QuotaLedger, Reservation
from promptcache.server.tenants import Quota
from tests.conftest import make_tiny_runtime
from tests.server.test_api import SCHEMA

NUM_UPLOADS = 16
QUOTA = 3


def _schema(i: int) -> str:
    return SCHEMA.replace('name="docs"', f'name="s{i}"')


def _upload_all(urls: list[str], headers: dict | None = None) -> list[httpx.Response]:
    """NUM_UPLOADS distinct schemas at once, spread over `urls`."""
    barrier = threading.Barrier(NUM_UPLOADS)

    def upload(i: int) -> httpx.Response:
        barrier.wait()
        return httpx.post(urls[i % len(urls)] + "/v1/schemas", json={"pml": _schema(i)}, headers=headers,
                          timeout=120)

    with concurrent.futures.ThreadPoolExecutor(NUM_UPLOADS) as pool:
        return list(pool.map(upload, range(NUM_UPLOADS)))


def _names(server) -> set[str]:
    return {s["name"] for s in httpx.get(server.url + "/v1/schemas").json()["data"]}


def _wait(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.mark.parametrize("limit", ["max_schemas", "max_schema_tokens"])
def test_sixteen_concurrent_uploads_over_two_servers_never_exceed_the_quota(live_server, redis_server, limit):
    tokens = make_tiny_runtime().parse_schema(_schema(0)).num_positions  # the servers' model and tokenizer
    quota = {"tenant_max_schemas": QUOTA} if limit == "max_schemas" else \
        {"tenant_max_schema_tokens": QUOTA * tokens + tokens // 2}  # room for 3 schemas and a half
    one = live_server(redis_url=redis_server.url, **quota)
    two = live_server(redis_url=redis_server.url, **quota)
    responses = _upload_all([one.url, two.url])
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [201] * QUOTA + [429] * (NUM_UPLOADS - QUOTA), [r.text for r in responses]
    assert all(r.json()["error"]["type"] == "quota_exceeded" for r in responses if r.status_code == 429)
    for server in (one, two):  # both see the same three, and the registry holds exactly those
        assert len(httpx.get(server.url + "/v1/schemas").json()["data"]) == QUOTA
    raw = redis.Redis.from_url(redis_server.url)
    assert len(raw.hkeys("promptcache:default:schemas")) == QUOTA
    # Deleting one frees its share on every replica: the next upload goes through the other server.
    created = [r.json()["name"] for r in responses if r.status_code == 201]
    assert httpx.delete(f"{one.url}/v1/schemas/{created[0]}").status_code == 204
    assert httpx.post(two.url + "/v1/schemas", json={"pml": _schema(99)}).status_code == 201
    assert httpx.post(one.url + "/v1/schemas", json={"pml": _schema(98)}).status_code == 429


def test_sixteen_concurrent_uploads_in_one_process_never_exceed_the_quota(live_server):
    server = live_server(tenant_max_schemas=QUOTA)
    statuses = sorted(r.status_code for r in _upload_all([server.url]))
    assert statuses == [201] * QUOTA + [429] * (NUM_UPLOADS - QUOTA)
    assert len(httpx.get(server.url + "/v1/schemas").json()["data"]) == QUOTA


def test_failed_and_refused_uploads_release_their_reservation(live_server, redis_server, monkeypatch):
    server = live_server(redis_url=redis_server.url, tenant_max_schemas=2)
    service = server.app.state.service
    real = service.runtime.engine.encode_schema
    gate, entered = threading.Event(), threading.Event()

    def failing(schema, salt=None, **options):
        if schema.name == "broken":
            raise RuntimeError("encoding blew up")
        if schema.name not in ("slow", "gone"):
            return real(schema, salt, **options)
        future = concurrent.futures.Future()

        def encode_when_let() -> None:  # an encode that takes until the test lets it finish
            entered.set()
            gate.wait(30)
            future.set_result(real(schema, salt, **options).result())

        threading.Thread(target=encode_when_let, daemon=True).start()
        return future

    monkeypatch.setattr(service.runtime.engine, "encode_schema", failing)
    broken = SCHEMA.replace('name="docs"', 'name="broken"')
    assert httpx.post(server.url + "/v1/schemas", json={"pml": broken}).status_code == 500
    # The same name twice at once: the second is refused while the first encodes (409), and releases nothing
    # of the first's.
    slow = SCHEMA.replace('name="docs"', 'name="slow"')
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, server.url + "/v1/schemas", json={"pml": slow}, timeout=60)
        assert entered.wait(30)
        twin = httpx.post(server.url + "/v1/schemas", json={"pml": slow})
        assert twin.status_code == 409 and "being uploaded" in twin.json()["error"]["message"]
        gate.set()
        assert pending.result().status_code == 201
    # A client that gives up mid-upload: whether the server finishes that upload or not, nothing leaks.
    gate.clear()
    entered.clear()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/schemas", json={"pml": slow.replace('"slow"', '"gone"')}, timeout=0.5)
    gate.set()
    _wait(lambda: service.quotas.usage(None)[0] == len(_names(server)))
    # Exactly the quota is usable: nothing failed or abandoned above holds a share.
    uploads = [httpx.post(server.url + "/v1/schemas", json={"pml": _schema(i)}) for i in range(3)]
    assert len(_names(server)) == 2, [u.status_code for u in uploads]
    assert uploads[-1].status_code == 429


def test_schemas_stored_before_a_quota_count_against_it(live_server, redis_server):
    unlimited = live_server(redis_url=redis_server.url)
    for i in range(3):
        assert httpx.post(unlimited.url + "/v1/schemas", json={"pml": _schema(i)}).status_code == 201
    limited = live_server(redis_url=redis_server.url, tenant_max_schemas=4)  # counts the three at start
    assert httpx.post(limited.url + "/v1/schemas", json={"pml": _schema(3)}).status_code == 201
    over = httpx.post(limited.url + "/v1/schemas", json={"pml": _schema(4)})
    assert over.status_code == 429 and "has 4 schemas" in over.json()["error"]["message"]


def test_after_a_blob_key_rotation_a_tenant_at_its_quota_uploads_its_schema_again(live_server, redis_server):
    old = live_server(redis_url=redis_server.url, blob_key="o" * 32, tenant_max_schemas=1)
    assert httpx.post(old.url + "/v1/schemas", json={"pml": SCHEMA}).status_code == 201
    old.stop()
    new = live_server(redis_url=redis_server.url, blob_key="n" * 32, tenant_max_schemas=1)
    assert _names(new) == set()  # the old document fails the new key's check
    again = httpx.post(new.url + "/v1/schemas", json={"pml": SCHEMA})
    assert again.status_code == 201, again.text  # its stale share does not hold the name or the quota
    assert httpx.post(new.url + "/v1/schemas", json={"pml": _schema(1)}).status_code == 429


def test_a_lapsed_reservation_and_an_entry_whose_schema_is_gone_free_their_share(redis_server):
    quota = Quota(max_schemas=2)
    ledger = QuotaLedger(redis_server.url, lease_s=0.3)
    kept = ledger.reserve("alpha", "kept", 10, quota)
    ledger.commit(kept, "v-kept")
    ledger.reserve("alpha", "crashed", 10, quota)  # a replica died mid-upload: never committed or released
    with pytest.raises(Exception, match="quota is 2"):
        ledger.reserve("alpha", "next", 10, quota)
    time.sleep(0.5)  # the lease ends
    ledger.reserve("alpha", "next", 10, quota)
    # A committed entry whose schema the registry no longer holds (a delete whose release never ran) is
    # pruned when it would refuse an upload; one it holds at that version is kept.
    registry = {"kept": "v-kept"}
    with pytest.raises(Exception, match="quota is 2"):
        ledger.reserve("alpha", "third", 10, quota, lambda: registry)  # "next" is in flight: not pruned
    ledger.commit(Reservation("alpha", "next", 10, "not-its-id"), "v-next")  # another's commit: no effect
    assert ledger.usage("alpha") == (2, 20)
    raw = redis.Redis.from_url(redis_server.url)
    raw.hset("promptcache:default:quota:alpha", "next", json.dumps({"tokens": 10, "id": "v-gone", "deadline": None}))
    ledger.reserve("alpha", "third", 10, quota, lambda: registry)
    assert set(raw.hkeys("promptcache:default:quota:alpha")) == {b"kept", b"third"}
    assert ledger.usage("beta") == (0, 0)  # per tenant


@pytest.mark.parametrize("shared", [True, False])
def test_a_delete_released_after_a_reupload_reserved_the_name_keeps_the_reupload_counted(redis_server, shared):
    # DELETE of "docs" v1 and an upload of "docs" interleave: the delete removes the registry entry, the upload
    # reserves the name (pruning v1's share, whose schema the registry no longer holds), then the delete releases
    # v1's share. The release must leave the upload's reservation alone, or the tenant ends over its quota.
    ledger = QuotaLedger(redis_server.url if shared else None)
    quota = Quota(max_schemas=1)
    first = ledger.reserve("alpha", "docs", 10, quota)
    ledger.commit(first, "v1")
    registry: dict[str, str] = {}  # the delete removed "docs" from the registry
    second = ledger.reserve("alpha", "docs", 12, quota, lambda: registry)
    ledger.forget("alpha", "docs", "v1")  # the delete's release, after the re-upload reserved the name
    assert ledger.usage("alpha") == (1, 12)
    ledger.commit(second, "v2")
    registry["docs"] = "v2"
    with pytest.raises(Exception, match="quota is 1"):
        ledger.reserve("alpha", "other", 1, quota, lambda: registry)
    ledger.forget("alpha", "docs", "v2")  # deleting the re-upload frees its share
    assert ledger.usage("alpha") == (0, 0)


@pytest.mark.parametrize("shared", [True, False])
def test_an_upload_cancelled_mid_encode_releases_its_reservation(redis_server, shared):
    ledger = QuotaLedger(redis_server.url if shared else None)
    quota = Quota(max_schemas=1)

    async def scenario() -> None:
        entered = asyncio.Event()

        async def upload() -> None:
            async with ledger.hold(None, "docs", 7, quota, lambda: None):
                entered.set()
                await asyncio.sleep(60)  # encoding, when the client goes away

        task = asyncio.create_task(upload())
        await entered.wait()
        assert ledger.usage(None) == (1, 7)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ledger.usage(None) == (0, 0)
        async with ledger.hold(None, "docs", 7, quota, lambda: None) as hold:
            hold.commit("v1")
        assert ledger.usage(None) == (1, 7)

    asyncio.run(scenario())


def test_listing_and_quota_checks_read_only_the_callers_schemas(live_server, redis_server, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-a": "alpha", "sk-b": "beta"}, "quotas": {"alpha": {"max_schemas": 5}}}))
    reader = live_server(redis_url=redis_server.url, api_keys_file=str(keys), registry_poll_s=60)
    writer = live_server(redis_url=redis_server.url, api_keys_file=str(keys))
    alpha, beta = {"Authorization": "Bearer sk-a"}, {"Authorization": "Bearer sk-b"}
    for i in range(4):
        assert httpx.post(writer.url + "/v1/schemas", json={"pml": _schema(i)}, headers=beta).status_code == 201
    assert httpx.post(writer.url + "/v1/schemas", json={"pml": _schema(0)}, headers=alpha).status_code == 201
    raw = redis.Redis.from_url(redis_server.url)
    raw.config_set("slowlog-max-len", 100000)
    raw.config_set("slowlog-log-slower-than", 0)  # every command, with its arguments
    raw.slowlog_reset()
    listed = httpx.get(reader.url + "/v1/schemas", headers=alpha)
    assert [s["name"] for s in listed.json()["data"]] == ["s0"]  # adopted from the registry
    assert httpx.post(reader.url + "/v1/schemas", json={"pml": _schema(9)}, headers=alpha).status_code == 201
    commands = [entry["command"] for entry in raw.slowlog_get(100000)]
    assert any(b"alpha/s0" in command for command in commands)
    assert not [command for command in commands if b"beta/" in command]  # no document of beta's was read

"""Redis trust (docs/security.md): HMAC-signed blobs and registry entries, ACL users, TLS — against real
redis-servers."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time

import pytest
import redis
import torch

from promptcache.cache_store import BlobSigner, KVBlock, RedisTier, SchemaRegistry
from promptcache.cache_store.redis_tier import redacted
from tests.redis_server import free_port

KEY = b"k" * 32


def blk(tokens: int, fill: float = 1.0) -> KVBlock:
    keys = torch.full((2, 2, tokens, 8), fill)
    return KVBlock(keys, keys * 2, torch.arange(tokens))


def raw_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=2)


def test_signed_blob_roundtrips_and_any_alteration_is_a_logged_miss(redis_server, caplog):
    tier = RedisTier(redis_server.url, max_bytes=1 << 20, namespace="s", signer=BlobSigner(KEY))
    tier.put("a", blk(3, 5.0))
    tier.put("b", blk(3, 6.0))
    hit = tier.get("a")
    assert hit is not None and float(hit.keys.flatten()[0]) == 5.0

    client = raw_client(redis_server.url)
    blob = client.get("promptcache:s:kv:a")
    client.set("promptcache:s:kv:a", blob[:-1] + bytes([blob[-1] ^ 1]))  # one bit of the KV flipped
    with caplog.at_level(logging.WARNING, logger="promptcache.cache_store"):
        assert tier.get("a") is None  # the sealed table's SHA-256 digest of its chunk no longer matches
    assert "checksum mismatch" in caplog.text
    tier.put("a", blk(3, 5.0))
    blob = client.get("promptcache:s:kv:a")
    table = len(blob) - 3 * 8 - 2 * 2 * 2 * 3 * 8 * 4 - 1  # the last byte of the table (positions, then keys, values)
    client.set("promptcache:s:kv:a", blob[:table] + bytes([blob[table] ^ 1]) + blob[table + 1:])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="promptcache.cache_store"):
        assert tier.get("a") is None  # a digest altered to match altered KV: the seal over the table fails
    assert "failed its HMAC check" in caplog.text

    client.set("promptcache:s:kv:a", client.get("promptcache:s:kv:b"))  # a valid blob moved to another key
    assert tier.get("a") is None

    unsigned = RedisTier(redis_server.url, max_bytes=1 << 20, namespace="s")  # a writer without the key
    unsigned.put("c", blk(3, 7.0))
    assert unsigned.get("c") is not None  # what it wrote, it reads (no key: no checks)
    assert tier.get("c") is None  # a keyed reader refuses the unsigned (forgeable) value, and drops it
    assert not client.exists("promptcache:s:kv:c")
    assert tier.get("b") is not None  # the untouched entry still reads
    assert RedisTier(redis_server.url, max_bytes=1 << 20, namespace="s", signer=BlobSigner(b"x" * 32)).get("b") is None
    assert not client.exists("promptcache:s:kv:b")  # for a reader with another key, it failed: dropped


def test_signed_registry_refuses_altered_entries(redis_server):
    registry = SchemaRegistry(redis_server.url, namespace="s", signer=BlobSigner(KEY))
    registry.save("docs", "<schema name='docs'><module name='m'>hi</module></schema>", {"num_tokens": 3})
    assert registry.load("docs").pml_text.startswith("<schema name='docs'>")

    client = raw_client(redis_server.url)
    value = client.get("promptcache:s:schema:docs")
    client.set("promptcache:s:schema:docs", value.replace(b"hi", b"yo"))
    assert SchemaRegistry(redis_server.url, namespace="s", signer=BlobSigner(KEY)).load("docs") is None
    client.set("promptcache:s:schema:planted", b'{"name": "planted", "pml_text": "<schema name=\'planted\'/>"}')
    fresh = SchemaRegistry(redis_server.url, namespace="s", signer=BlobSigner(KEY))
    assert fresh.load("planted") is None and [s.name for s in fresh.list()] == []


def test_blob_key_must_be_long_enough():
    with pytest.raises(ValueError, match="16 bytes"):
        BlobSigner(b"short")


def _start_redis(tmp_path, *args: str) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed (scripts/install.sh installs it)"
    return subprocess.Popen([binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_ready(tier: RedisTier) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            tier.client.ping()
            return
        except (redis.RedisError, OSError):
            time.sleep(0.05)
    raise RuntimeError("redis-server did not answer")


def test_acl_user_and_password_from_the_url(tmp_path):
    port = free_port()
    process = _start_redis(tmp_path, "--port", str(port), "--user", "default", "off",
                           "--user", "cache", "on", ">s3cret-pass", "~*", "&*", "+@all")
    try:
        url = f"redis://cache:s3cret-pass@127.0.0.1:{port}/0"
        tier = RedisTier(url, max_bytes=1 << 20, namespace="acl")
        _wait_ready(tier)
        tier.put("a", blk(2, 3.0))
        assert float(tier.get("a").keys.flatten()[0]) == 3.0
        wrong = RedisTier(f"redis://cache:nope@127.0.0.1:{port}/0", max_bytes=1 << 20, namespace="acl")
        assert wrong.get("a") is None  # refused by the server: a miss, never an error
        assert "nope" not in wrong.guard.what and "***" in wrong.guard.what  # no password in logs
    finally:
        process.kill()
        process.wait(timeout=10)


def test_tls_url_connects_with_the_given_ca(tmp_path):
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed (needed to make a test certificate)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    port = free_port()
    process = _start_redis(tmp_path, "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
                           "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no")
    try:
        tier = RedisTier(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}", max_bytes=1 << 20, namespace="tls")
        assert isinstance(tier.client.connection_pool.connection_class(), redis.SSLConnection)
        _wait_ready(tier)
        tier.put("a", blk(2, 4.0))
        assert float(tier.get("a").keys.flatten()[0]) == 4.0
        plain = RedisTier(f"redis://127.0.0.1:{port}/0", max_bytes=1 << 20, namespace="tls", timeout_s=0.3)
        assert plain.get("a") is None  # a plaintext client cannot talk to the TLS port
    finally:
        process.kill()
        process.wait(timeout=10)


def test_redacted_hides_only_the_password():
    assert redacted("rediss://u:pw@h:6380/0?x=1") == "rediss://u:***@h:6380/0?x=1"
    assert redacted("redis://h:6379/0") == "redis://h:6379/0"

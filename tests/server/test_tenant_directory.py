"""The keys file, key -> tenant lookup, quota overrides and the rate limiter (no server needed)."""

from __future__ import annotations

import json

import pytest

from promptcache.server.errors import RateLimitedError, UnauthorizedError
from promptcache.server.tenants import (
    Quota,
    RequestRateLimiter,
    TenantDirectory,
    registry_name,
    split_registry_name,
)


def _load(tmp_path, content, api_keys=(), quota: Quota | None = None) -> TenantDirectory:
    path = tmp_path / "keys.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return TenantDirectory.load(str(path), list(api_keys), quota or Quota())


def test_plain_mapping_and_api_keys_share_one_directory(tmp_path):
    directory = _load(tmp_path, {"sk-a1": "alpha", "sk-a2": "alpha", "sk-b1": "beta"}, api_keys=["root"])
    assert directory.authenticate("Bearer sk-a1") == "alpha" == directory.authenticate("bearer sk-a2")
    assert directory.authenticate("Bearer sk-b1") == "beta"
    assert directory.authenticate("Bearer root") is None  # --api-key: the default tenant
    for bad in ("Bearer sk-a", "Bearer sk-a1 ", "Basic sk-a1", "sk-a1", "", "Bearer "):
        with pytest.raises(UnauthorizedError):
            directory.authenticate(bad)


def test_no_keys_is_the_open_single_tenant_mode():
    directory = TenantDirectory.load(None, [], Quota())
    assert not directory.requires_key and directory.authenticate("") is None


def test_quota_overrides_apply_per_tenant(tmp_path):
    directory = _load(tmp_path, {"keys": {"k1": "alpha", "k2": "beta"},
                                 "quotas": {"alpha": {"max_schemas": 2, "rate_limit": "5/second"}}},
                      quota=Quota(max_schema_tokens=1000))
    assert directory.quota("alpha") == Quota(max_schemas=2, max_schema_tokens=1000, rate_limit="5/second")
    assert directory.quota("beta") == Quota(max_schema_tokens=1000) == directory.quota(None)


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "cannot read"),
    ([["k", "alpha"]], "mapping each API key"),
    ({"k": 3}, "mapping each API key"),
    ({"k": "has space"}, "tenant name"),
    ({"k": "_default"}, "tenant name"),
    ({"": "alpha"}, "non-empty"),
    ({}, "lists no API key"),
    ({"keys": {}, "quotas": {}}, "lists no API key"),
    ({"keys": {"k": "alpha"}, "quotas": {"alpha": {"max_rps": 3}}}, "takes only"),
    ({"keys": {"k": "alpha"}, "quotas": {"alpha": {"rate_limit": "fast"}}}, "rate_limit"),
    ({"keys": {"k": "alpha"}, "quotas": {"alpha": {"max_schemas": -1}}}, "max_schemas"),
])
def test_a_bad_keys_file_names_what_is_wrong(tmp_path, content, message):
    with pytest.raises(ValueError, match=message):
        _load(tmp_path, content)


def test_missing_keys_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        TenantDirectory.load(str(tmp_path / "absent.json"), [], Quota())


def test_rate_limiter_counts_each_tenant_separately():
    directory = TenantDirectory({"a": "alpha", "b": "beta"}, Quota(rate_limit="2/minute"))
    limiter = RequestRateLimiter(directory)
    limiter.check("alpha")
    limiter.check("alpha")
    with pytest.raises(RateLimitedError) as raised:
        limiter.check("alpha")
    assert 1 <= int(raised.value.headers["Retry-After"]) <= 60
    limiter.check("beta")  # beta's window is its own
    unlimited = RequestRateLimiter(TenantDirectory({"a": "alpha"}))
    for _ in range(100):
        unlimited.check("alpha")


def test_registry_names_keep_tenants_apart():
    assert registry_name(None, "docs") == "docs" and split_registry_name("docs") == (None, "docs")
    assert split_registry_name(registry_name("alpha", "docs")) == ("alpha", "docs")
    assert registry_name("alpha", "docs") != registry_name("beta", "docs")

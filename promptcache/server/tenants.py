"""Tenants: who an API key belongs to (never the request body: schemas live in the tenant's namespace, every KV key is
salted with it), each tenant's quotas, and the request-rate limiter. With no keys file all are the default tenant
(`None`). The keys file maps keys to tenants: `{"sk-a1": "alpha"}` or `{"keys": {...}, "quotas": {"alpha": {...}}}`."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

from limits import parse as parse_rate
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

from promptcache.server.errors import RateLimitedError, RequestRejectedError, UnauthorizedError

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # fullmatch: `$` lets a final "\n" through
DEFAULT_TENANT_LABEL = "_default"  # how the default tenant appears in metrics (no tenant name starts with '_')


@dataclass(frozen=True, slots=True)
class Quota:
    """Limits one tenant lives within; None: unlimited."""

    max_schemas: int | None = None
    max_schema_tokens: int | None = None  # positions summed over the tenant's schemas
    rate_limit: str | None = None  # samples (prompts x n), in the `limits` library's notation: "10/second"
    cache_share: float | None = None  # most of each KV tier's bytes (device, host, Redis) the tenant may hold

    def __post_init__(self) -> None:
        for name in ("max_schemas", "max_schema_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"quota {name} must be a non-negative integer, got {value!r}")
        if self.cache_share is not None and not (isinstance(self.cache_share, (int, float))
                                                 and 0 < self.cache_share <= 1):
            raise ValueError(f"quota cache_share must be a fraction in (0, 1], got {self.cache_share!r}")
        if self.rate_limit is not None:
            try:
                parse_rate(self.rate_limit)
            except ValueError:
                raise ValueError(f"quota rate_limit must look like '10/second' or '600/minute', got "
                                 f"{self.rate_limit!r}") from None


def tenant_label(tenant: str | None) -> str:
    return DEFAULT_TENANT_LABEL if tenant is None else tenant


def registry_name(tenant: str | None, name: str) -> str:
    """A schema's name in the shared registry: `<tenant>/<name>` ('/' is in neither), bare for the default."""
    return name if tenant is None else f"{tenant}/{name}"


def split_registry_name(qualified: str) -> tuple[str | None, str]:
    tenant, slash, name = qualified.partition("/")
    return (tenant, name) if slash else (None, qualified)


class TenantDirectory:
    """API keys -> tenants, and each tenant's quota. Keys are compared as SHA-256 digests against every known key with
    no early exit, so the time taken says nothing about which key (or how much of one) matched."""

    def __init__(self, keys: Mapping[str, str | None], default_quota: Quota = Quota(),
                 quotas: Mapping[str, Quota] | None = None) -> None:
        for tenant in {t for t in keys.values() if t is not None} | set(quotas or {}):
            if not TENANT_NAME.fullmatch(tenant):
                raise ValueError(f"tenant name {tenant!r} is invalid: expected 1-64 letters, digits, '_', '.' or "
                                 "'-', starting with a letter or digit")
        if any(not key for key in keys):
            raise ValueError("API keys must be non-empty")
        self._digests = [(hashlib.sha256(key.encode()).digest(), tenant) for key, tenant in keys.items()]
        self.default_quota = default_quota
        self._quotas = dict(quotas or {})

    @classmethod
    def load(cls, keys_file: str | None, api_keys: list[str], default_quota: Quota) -> TenantDirectory:
        """Keys of `keys_file` (its `quotas` override the default) and `api_keys` (default tenant); bad: ValueError."""
        keys: dict[str, str | None] = dict.fromkeys(api_keys)
        quotas: dict[str, Quota] = {}
        if keys_file:
            try:
                data = json.loads(Path(keys_file).read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"cannot read the API keys file {keys_file}: {exc}") from None
            mapping = data.get("keys") if isinstance(data, dict) and "keys" in data else data
            if not isinstance(mapping, dict) or not all(isinstance(t, str) for t in mapping.values()):
                raise ValueError(f"{keys_file}: expected a JSON object mapping each API key to a tenant name")
            if not mapping:  # a keys file means keys: one with none would leave the server open
                raise ValueError(f"{keys_file}: lists no API key; add keys, or unset the keys file for a server "
                                 "without authentication")
            overrides = data.get("quotas", {}) if mapping is not data else {}
            if not isinstance(overrides, dict):
                raise ValueError(f"{keys_file}: 'quotas' must map tenant names to quota objects")
            for tenant, entry in overrides.items():
                known = {f.name for f in fields(Quota)}
                if not isinstance(entry, dict) or set(entry) - known:
                    raise ValueError(f"{keys_file}: quotas[{tenant!r}] takes only {sorted(known)}")
                quotas[tenant] = replace(default_quota, **entry)
            keys.update(mapping)
        return cls(keys, default_quota, quotas)

    @property
    def requires_key(self) -> bool:
        return bool(self._digests)

    def authenticate(self, authorization: str) -> str | None:
        """The tenant of a Bearer key in an Authorization header (None: default); UnauthorizedError if not a key."""
        if not self._digests:
            return None
        scheme, _, token = authorization.partition(" ")
        presented = hashlib.sha256(token.encode()).digest()
        found, tenant = False, None
        for digest, owner in self._digests:  # no early exit: constant time in which key matched
            if hmac.compare_digest(presented, digest) and scheme.lower() == "bearer":
                found, tenant = True, owner
        if not found:
            raise UnauthorizedError("missing or invalid API key (send Authorization: Bearer <key>)")
        return tenant

    def quota(self, tenant: str | None) -> Quota:
        return self.default_quota if tenant is None else self._quotas.get(tenant, self.default_quota)

    def cache_shares(self) -> dict[str, float]:
        """Tenant -> its byte share of each KV tier, for tenants that have one."""
        tenants = {t for _, t in self._digests if t is not None} | set(self._quotas)
        return {t: share for t in sorted(tenants) if (share := self.quota(t).cache_share) is not None}


class RequestRateLimiter:
    """Per-tenant request rates (moving window, in memory), one hit per sample (prompts × n; one on other routes): the
    guard counts one on arrival, the generating routes the rest once the body is read."""

    def __init__(self, directory: TenantDirectory) -> None:
        self.directory = directory
        self._limiter = MovingWindowRateLimiter(MemoryStorage())

    def check(self, tenant: str | None, cost: int = 1, *, already_counted: int = 0) -> None:
        """Count a request of `cost` hits, `already_counted` of them before. Raises RequestRejectedError when `cost`
        exceeds the tenant's whole window, RateLimitedError (with the wait) past its rate."""
        rate = self.directory.quota(tenant).rate_limit
        if rate is None or cost <= already_counted:
            return
        item, key = parse_rate(rate), tenant_label(tenant)
        if cost > item.amount:
            raise RequestRejectedError(f"this request asks for {cost} samples (prompts x n), more than the tenant's "
                                       f"whole rate limit of {rate} admits: send fewer prompts or a smaller n")
        if not self._limiter.hit(item, key, cost=cost - already_counted):
            reset_at = self._limiter.get_window_stats(item, key).reset_time
            wait = max(1, math.ceil(reset_at - time.time()))
            raise RateLimitedError(f"rate limit of {rate} exceeded (a request counts prompts x n, this one {cost}); "
                                   f"retry in {wait} s", retry_after_s=wait)

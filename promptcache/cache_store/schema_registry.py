"""Uploaded schema documents, persisted in Redis when configured so replicas and restarts see them."""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import redis

from promptcache.cache_store.errors import RegistryUnavailableError, SchemaExistsError, logger
from promptcache.cache_store.signing import BlobSigner

# KEYS: entry. ARGV: expected value, new value. Sets the entry only if it still holds exactly the expected
# value (a registry entry that failed verification). Returns 1 if set.
REPLACE_IF_UNCHANGED = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""

# KEYS: entry, index, deleted. ARGV: name, now, tombstone_s. Deletes the entry and leaves its tombstone; returns 1
# if the entry existed. A script, not a MULTI: Redis at its maxmemory refuses every MULTI, and a script only its
# first write that may grow memory (the DEL first cannot), so a delete, which frees memory, works on a full Redis.
DELETE = """
local existed = redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', tonumber(ARGV[2]) - tonumber(ARGV[3]))
return existed
"""


@dataclass(frozen=True, slots=True)
class StoredSchema:
    name: str
    pml_text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    version: str = ""  # changes with every save: replicas compare it to learn of replacements


class SchemaRegistry:
    """Schema documents by (opaque) name: in memory, and in Redis too when `redis_url` is given. `save` raises
    SchemaExistsError for a taken name, RegistryUnavailableError when Redis cannot be written; `load`/`list`
    fall back to this process's copies, with a warning. `state` lets replicas follow deletes and replacements;
    a delete leaves a tombstone for `tombstone_s`, so a schema deleted is told from one Redis lost (that one is
    `restore`d). An entry that fails verification (HMAC under a keyed `signer`, or decoding) reads as absent and
    a `save` or `restore` may replace it; it is not deleted on read (a schema is not cache: restoring a key
    rotated by mistake brings the entries back)."""

    def __init__(self, redis_url: str | None = None, *, namespace: str = "default", timeout_s: float = 0.5,
                 tombstone_s: float = 3600.0, signer: BlobSigner | None = None) -> None:
        self._signer = signer or BlobSigner()
        self._local: dict[str, StoredSchema] = {}
        self._lock = threading.Lock()
        self._prefix = f"promptcache:{namespace}:schema:"
        self._index = f"promptcache:{namespace}:schemas"  # hash: name -> version
        self._deleted = f"promptcache:{namespace}:schemas_deleted"  # sorted set: name by deletion time
        self._tombstone_s = tombstone_s
        self._client: redis.Redis | None = None
        if redis_url:
            self._client = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
            self._replace_if_unchanged = self._client.register_script(REPLACE_IF_UNCHANGED)
            self._delete = self._client.register_script(DELETE)

    def save(self, name: str, pml_text: str, metadata: dict[str, Any] | None = None) -> StoredSchema:
        stored = StoredSchema(name, pml_text, dict(metadata or {}), time.time(), uuid.uuid4().hex)
        if self._client is not None:
            try:
                if not self._claim(stored):
                    raise SchemaExistsError(f"schema {name!r} already exists")
                pipe = self._client.pipeline(transaction=True)
                pipe.hset(self._index, name, stored.version)
                pipe.zrem(self._deleted, name)
                pipe.execute()
            except redis.RedisError as exc:
                raise RegistryUnavailableError(f"cannot save schema {name!r} to Redis: {exc}") from None
        with self._lock:
            if name in self._local and self._client is None:
                raise SchemaExistsError(f"schema {name!r} already exists")
            self._local[name] = stored
        return stored

    def load(self, name: str) -> StoredSchema | None:
        if self._client is not None:
            try:
                raw = self._get(self._prefix + name)
            except redis.RedisError as exc:
                logger.warning("schema registry unavailable (%s); using this process's copy", exc)
            else:
                stored = None if raw is None else self._verified(name, raw)
                with self._lock:
                    if stored is None:  # absent, or failed verification (logged): never adopt it
                        self._local.pop(name, None)
                    else:
                        self._local[name] = stored
                return stored
        with self._lock:
            return self._local.get(name)

    def list(self) -> list[StoredSchema]:
        if self._client is not None:
            try:
                names = [k.decode()[len(self._prefix):] for k in self._client.scan_iter(self._prefix + "*")]
                return [s for s in (self.load(n) for n in sorted(names)) if s is not None]
            except redis.RedisError as exc:
                logger.warning("schema registry unavailable (%s); listing this process's copies", exc)
        with self._lock:
            return sorted(self._local.values(), key=lambda s: s.name)

    def delete(self, name: str) -> bool:
        removed = False
        if self._client is not None:
            try:
                removed = bool(self._delete(keys=[self._prefix + name, self._index, self._deleted],
                                            args=[name, repr(time.time()), repr(self._tombstone_s)]))
            except redis.RedisError as exc:
                raise RegistryUnavailableError(f"cannot delete schema {name!r} from Redis: {exc}") from None
        with self._lock:
            removed = self._local.pop(name, None) is not None or removed
        return removed

    def restore(self, stored: StoredSchema) -> bool:
        """Write back a schema the shared registry lost, with its version (replicas serving it see no change),
        unless the name is taken meanwhile. True if written."""
        if self._client is None:
            return False
        try:
            if not self._claim(stored):
                return False
            self._client.hset(self._index, stored.name, stored.version)
        except redis.RedisError as exc:
            logger.warning("cannot restore schema %r to the registry (%s)", stored.name, exc)
            return False
        with self._lock:
            self._local[stored.name] = stored
        return True

    def _claim(self, stored: StoredSchema) -> bool:
        """Write `stored` under its name unless that holds an entry that passes verification; a failing entry
        is replaced only if it is still the bytes checked (a rightful write meanwhile wins). Raises RedisError."""
        name, key = stored.name, self._prefix + stored.name
        value = self._signer.seal(key, json.dumps(asdict(stored)).encode())
        assert self._client is not None, "only a registry on Redis claims names"
        for _ in range(8):  # each round, someone else wrote the name; give up (taken) after a few
            if self._client.set(key, value, nx=True):
                return True
            current = self._get(key)
            if current is None:
                continue  # deleted meanwhile: try to take it again
            if self._verified(name, current) is not None:
                return False
            if self._replace_if_unchanged(keys=[key], args=[current, value]):
                logger.warning("schema registry entry %r failed verification; replaced it", name)
                return True
        return False

    def _get(self, key: str) -> bytes | None:
        """The value under `key` in Redis: bytes, as this client does not decode responses."""
        assert self._client is not None, "only a registry on Redis reads it"
        return cast("bytes | None", self._client.get(key))

    def _verified(self, name: str, raw: bytes) -> StoredSchema | None:
        """The entry in `raw` (read under `name`) if it passes verification, else None (logged)."""
        value = self._signer.open(self._prefix + name, raw)
        if value is None:
            return None
        try:
            data = json.loads(value)
            return StoredSchema(data["name"], data["pml_text"], data.get("metadata", {}), data.get("created_at", 0.0),
                                data.get("version", ""))
        except (ValueError, KeyError, TypeError) as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            logger.warning("schema registry entry %r cannot be decoded (%s: %s); treating it as absent", name,
                           type(exc).__name__, exc)
            return None

    def state(self) -> RegistryState | None:
        """Versions and recent deletes of the shared registry; None without one (or when it cannot be reached:
        then nobody changed it either)."""
        if self._client is None:
            return None
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.hgetall(self._index)
            pipe.zrange(self._deleted, 0, -1)
            versions, deleted = pipe.execute()
        except redis.RedisError as exc:
            logger.warning("schema registry unavailable (%s); keeping this process's schemas", exc)
            return None
        return RegistryState({k.decode(): v.decode() for k, v in versions.items()},
                             frozenset(name.decode() for name in deleted))


@dataclass(frozen=True, slots=True)
class RegistryState:
    """What replicas follow: name -> version of every stored schema, and names deleted recently."""

    versions: dict[str, str]
    deleted: frozenset[str]

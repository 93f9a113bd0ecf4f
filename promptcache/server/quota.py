"""QuotaLedger: each tenant's schemas and uploads in flight, reserved against its quota before encoding (an atomic
check-and-reserve: a WATCH/MULTI transaction on the tenant's Redis hash, or a lock without Redis); a reservation's lease
is renewed while its upload runs, so a dead replica's upload frees its share when the lease ends."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar, cast

import redis
from redis.typing import EncodableT

from promptcache.cache_store import RegistryUnavailableError, SchemaExistsError
from promptcache.server.errors import QuotaExceededError
from promptcache.server.tenants import Quota, tenant_label

logger = logging.getLogger(__name__)
T = TypeVar("T")
Versions = Callable[[], Mapping[str, str] | None]  # the tenant's schema name -> registry version; None: unknown


@dataclass(frozen=True, slots=True)
class Entry:
    """A tenant's schema: committed (`deadline` None, `entry_id` its registry version) or an upload in flight
    (`entry_id` its reservation, `deadline` when the reservation lapses unless renewed)."""

    num_tokens: int
    entry_id: str
    deadline: float | None = None

    def is_expired(self, now: float) -> bool:
        return self.deadline is not None and self.deadline < now

    def dumps(self) -> str:
        return json.dumps({"tokens": self.num_tokens, "id": self.entry_id, "deadline": self.deadline})

    @classmethod
    def loads(cls, raw: bytes | str) -> Entry:
        data = json.loads(raw)
        return cls(int(data["tokens"]), str(data["id"]), data.get("deadline"))


@dataclass(frozen=True, slots=True)
class Reservation:
    tenant: str | None
    name: str
    num_tokens: int
    reservation_id: str


Changes = dict[str, Entry | None]  # name -> its new entry (None: removed)
Decision = Callable[[dict[str, Entry]], tuple[Changes, T]]


class QuotaLedger:
    """Reserves, commits and releases tenants' schemas against their quotas. Every method may raise
    RegistryUnavailableError, except `commit`, `release`, `forget` and `record`, which log it (the lease, pruning and
    the count at start repair what they could not write)."""

    def __init__(self, redis_url: str | None = None, *, namespace: str = "default", timeout_s: float = 0.5,
                 lease_s: float = 300.0) -> None:
        self.lease_s = lease_s
        self._prefix = f"promptcache:{namespace}:quota:"
        self._client = (redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
                        if redis_url else None)
        self._local: dict[str, dict[str, Entry]] = {}
        self._lock = threading.Lock()

    # -- the upload path -----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def hold(self, tenant: str | None, name: str, num_tokens: int, quota: Quota,
                   versions: Versions) -> AsyncIterator[Hold]:
        """Reserve `name` for the block, renewing the lease meanwhile; the block calls `hold.commit(version)` once the
        schema is registered, any other exit releases it. Unlimited quotas reserve nothing. Raises QuotaExceededError,
        SchemaExistsError (in flight, or it exists)."""
        hold = Hold()
        if quota.max_schemas is None and quota.max_schema_tokens is None:
            yield hold
            return
        reservation = await asyncio.to_thread(self.reserve, tenant, name, num_tokens, quota, versions)
        renewer = asyncio.create_task(self._renew_every(reservation))
        try:
            yield hold
        finally:  # a cancelled upload (its client gone) still releases: shielded, in a worker thread
            renewer.cancel()
            settle = self.release if hold.version is None else functools.partial(self.commit, version=hold.version)
            await asyncio.shield(asyncio.to_thread(settle, reservation))

    async def _renew_every(self, reservation: Reservation) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:  # push the lease deadline `lease_s` from now, if the reservation is still held
                await asyncio.to_thread(self._replace_own, reservation,
                                        lambda e: replace(e, deadline=time.time() + self.lease_s))
            except RegistryUnavailableError as exc:  # the next renewal may get through before the lease ends
                logger.warning("renewing the quota reservation of %r failed: %s", reservation.name, exc)

    def reserve(self, tenant: str | None, name: str, num_tokens: int, quota: Quota,
                versions: Versions = lambda: None) -> Reservation:
        """Reserve one schema of `num_tokens` for `tenant` if its quota allows, atomically with the check. A refusal
        first prunes committed entries that `versions()` (the registry) no longer holds, then tries once more."""
        reservation = Reservation(tenant, name, num_tokens, uuid.uuid4().hex)
        try:
            return self._update(tenant, lambda entries: self._admit(entries, reservation, quota))
        except (QuotaExceededError, SchemaExistsError):
            if not self.prune(tenant, versions):
                raise
        return self._update(tenant, lambda entries: self._admit(entries, reservation, quota))

    def _admit(self, entries: dict[str, Entry], reservation: Reservation, quota: Quota) -> tuple[Changes, Reservation]:
        now = time.time()
        changes: Changes = {name: None for name, entry in entries.items() if entry.is_expired(now)}
        live = {name: entry for name, entry in entries.items() if name not in changes}
        name = reservation.name
        if name in live:
            being = "is being uploaded" if live[name].deadline is not None else "already exists"
            raise SchemaExistsError(f"schema {name!r} {being}; DELETE it first to replace it")
        num_tokens = sum(entry.num_tokens for entry in live.values()) + reservation.num_tokens
        if quota.max_schemas is not None and len(live) + 1 > quota.max_schemas:
            raise QuotaExceededError(f"this tenant has {len(live)} schemas (uploads in flight included); its quota "
                                     f"is {quota.max_schemas} (delete one first)")
        if quota.max_schema_tokens is not None and num_tokens > quota.max_schema_tokens:
            raise QuotaExceededError(f"schema {name!r} would bring this tenant's schemas to {num_tokens} tokens "
                                     f"(uploads in flight included); its quota is {quota.max_schema_tokens}")
        changes[name] = Entry(reservation.num_tokens, reservation.reservation_id, now + self.lease_s)
        return changes, reservation

    def commit(self, reservation: Reservation, version: str) -> None:
        """The upload registered its schema as `version`: the reservation becomes the schema's share."""
        with _logged(f"committing the quota reservation of {reservation.name!r}"):
            self._replace_own(reservation, lambda e: Entry(e.num_tokens, version))

    def release(self, reservation: Reservation) -> None:
        """Give the reservation back (the upload failed); a lapsed or pruned one is left alone."""
        with _logged(f"releasing the quota reservation of {reservation.name!r}"):
            self._replace_own(reservation, lambda e: None)

    def _replace_own(self, reservation: Reservation, new: Callable[[Entry], Entry | None]) -> None:
        def decide(entries: dict[str, Entry]) -> tuple[Changes, None]:
            entry = entries.get(reservation.name)
            if entry is None or entry.entry_id != reservation.reservation_id:
                return {}, None
            return {reservation.name: new(entry)}, None

        self._update(reservation.tenant, decide)

    # -- schemas registered or deleted elsewhere ----------------------------------------------------
    def forget(self, tenant: str | None, name: str, version: str) -> None:
        """The tenant's schema `name` at registry `version` was deleted: its share is free. Only that committed entry
        goes: a re-upload of the name may have reserved it since (the delete had freed the name), and dropping its
        reservation would let the tenant's schemas pass its quota once the upload commits."""
        def decide(entries: dict[str, Entry]) -> tuple[Changes, None]:
            entry = entries.get(name)
            is_deleted = entry is not None and entry.deadline is None and entry.entry_id == version
            return ({name: None} if is_deleted else {}), None

        with _logged(f"releasing the quota share of schema {name!r}"):
            self._update(tenant, decide)

    def record(self, tenant: str | None, schemas: Mapping[str, tuple[int, str]]) -> None:
        """Count registered schemas (name -> (tokens, version)) the ledger lacks (stored before it, lost by Redis)."""
        def decide(entries: dict[str, Entry]) -> tuple[Changes, None]:
            return {n: Entry(tokens, version) for n, (tokens, version) in schemas.items() if n not in entries}, None

        with _logged("recording schemas in the quota ledger"):
            self._update(tenant, decide)

    def prune(self, tenant: str | None, versions: Versions) -> int:
        """Drop the tenant's committed entries whose schema the registry no longer holds at that version (deleted, lost,
        or failing its check). The ledger is read first, the registry after: an entry is committed only once its schema
        is registered, so no entry read here is newer than the registry's answer. Returns how many."""
        def decide(entries: dict[str, Entry]) -> tuple[Changes, int]:
            current = versions()
            if current is None:  # no shared registry (or unreachable): nothing to judge entries by
                return {}, 0
            stale: Changes = {name: None for name, entry in entries.items()
                              if entry.deadline is None and current.get(name) != entry.entry_id}
            if stale:
                logger.warning("dropping %d quota entries of tenant %s whose schemas are gone: %s", len(stale),
                               tenant_label(tenant), sorted(stale))
            return stale, len(stale)

        return self._update(tenant, decide)

    def usage(self, tenant: str | None) -> tuple[int, int]:
        """(schemas, tokens) the tenant holds now, uploads in flight included."""
        now = time.time()
        live = [e for e in self._update(tenant, lambda entries: ({}, list(entries.values()))) if not e.is_expired(now)]
        return len(live), sum(e.num_tokens for e in live)

    # -- storage ----------------------------------------------------------------------------------
    def _update(self, tenant: str | None, decide: Decision[T]) -> T:
        """Apply `decide(entries) -> (changes, result)` to the tenant's entries atomically; returns result."""
        key = self._prefix + tenant_label(tenant)
        if self._client is None:
            with self._lock:
                entries = self._local.setdefault(key, {})
                changes, result = decide(dict(entries))
                entries.update({name: entry for name, entry in changes.items() if entry is not None})
                for name in [name for name, entry in changes.items() if entry is None]:
                    entries.pop(name, None)
                return result

        def transaction(pipe: redis.client.Pipeline) -> T:
            stored = cast("dict[bytes, bytes]", pipe.hgetall(key))  # this client does not decode responses
            entries = {name.decode(): Entry.loads(raw) for name, raw in stored.items()}
            changes, result = decide(entries)
            pipe.multi()
            if removed := [name for name, entry in changes.items() if entry is None]:
                pipe.hdel(key, *removed)
            written: dict[EncodableT, EncodableT] = {name: entry.dumps() for name, entry in changes.items()
                                                     if entry is not None}
            if written:
                pipe.hset(key, mapping=written)
            return result

        try:  # retried by redis-py whenever another writer changed the hash between the read and the write
            # redis-py types the callable as returning None; value_from_callable returns what it returns
            return cast(T, self._client.transaction(transaction, key, value_from_callable=True))  # type: ignore[arg-type]
        except redis.RedisError as exc:
            raise RegistryUnavailableError(f"cannot update the quota ledger in Redis: {exc}") from None


@dataclass(slots=True)
class Hold:
    """What the upload block of `QuotaLedger.hold` reports: the registered schema's version."""

    version: str | None = None

    def commit(self, version: str) -> None:
        self.version = version


@contextlib.contextmanager
def _logged(what: str):
    try:
        yield
    except RegistryUnavailableError as exc:
        logger.warning("%s failed (a lease or pruning repairs it): %s", what, exc)

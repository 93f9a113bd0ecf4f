"""KVBudget: the running batch's KV bytes as admission and module encoding share them, overall and per tenant, and
the verdict on whether more fits: within the budget, and within the tenant's share while other tenants wait."""

from __future__ import annotations

import enum

from promptcache.model_runtime.engine.memory import KVMemory


class Fit(enum.Enum):
    """Whether a request's or an encoding's KV may be reserved now."""

    FITS = "fits"
    OVER_SHARE = "over_share"  # its tenant would pass its share while another tenant waits: passed over
    NO_ROOM = "no_room"  # the budget lacks room now: waits for memory, and nobody overtakes it
    NEVER = "never"  # more than the whole budget


class KVBudget:
    """`memory` (the whole budget) and each tenant's part of it: its sequences' own KV, the shared blocks they hold
    (each counted once per tenant) and its encodings' buffers. A tenant may hold at most `share` of the budget while
    another tenant has work waiting (`waiting_tenants`, set by the scheduler each step; `encoding_owners`, by the
    encode queue), unless it holds nothing (a request bigger than a share still runs). Engine thread only."""

    def __init__(self, max_bytes: int, share: float | None = None) -> None:
        self.memory = KVMemory(max_bytes)
        self.share_bytes = None if share is None else int(share * max_bytes)
        self.waiting_tenants: set[str | None] = set()  # tenants with requests queued or parked
        self.encoding_owners: set[str | None] = set()  # owners with encodings queued or running
        self.claims: set[str | None] = set()  # owners whose next encoding waits for room (NO_ROOM)
        self._tenants: dict[str | None, KVMemory] = {}

    def held_bytes(self, tenant: str | None) -> int:
        part = self._tenants.get(tenant)
        return 0 if part is None else part.used_bytes

    def verdict(self, tenant: str | None, own_bytes: int, shared: dict[str, int]) -> Fit:
        """Whether `tenant` may reserve `own_bytes` and the `shared` blocks now (they are not yet reserved)."""
        if self.memory.cost(own_bytes, shared) > self.memory.max_bytes:
            return Fit.NEVER
        part = self._tenants.get(tenant)
        if (self.share_bytes is not None and part is not None and part.used_bytes > 0
                and part.used_bytes + part.cost(own_bytes, shared) > self.share_bytes
                and (self.waiting_tenants | self.encoding_owners) - {tenant}):
            return Fit.OVER_SHARE
        return Fit.FITS if self.memory.fits(own_bytes, shared) else Fit.NO_ROOM

    def reserve(self, tenant: str | None, own_bytes: int, shared: dict[str, int]) -> None:
        self.memory.reserve(own_bytes, shared)
        self._tenants.setdefault(tenant, KVMemory(self.memory.max_bytes)).reserve(own_bytes, shared)

    def release(self, tenant: str | None, own_bytes: int, shared: dict[str, int]) -> None:
        self.memory.release(own_bytes, shared)
        part = self._tenants[tenant]
        part.release(own_bytes, shared)
        if part.used_bytes == 0:
            del self._tenants[tenant]

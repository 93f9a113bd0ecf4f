"""What a shared tier has verified in full: per key, a fingerprint (length and first bytes: the HMAC tag and
the block header with its checksum) of the value it last checked or wrote, so `contains` can vouch for that
value again without fetching it. A value altered behind an unchanged head is caught when it is read."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from promptcache.cache_store.block_layout import HEADER_BYTES
from promptcache.cache_store.signing import HEAD_SEAL_BYTES

HEAD_BYTES = HEAD_SEAL_BYTES + HEADER_BYTES  # the seal (when signed) and the block header: tag and checksum


def fingerprint(length: int, head: bytes) -> bytes:
    """The fingerprint of a value `length` bytes long starting with `head` (its first HEAD_BYTES)."""
    return hashlib.blake2b(length.to_bytes(8, "little") + head, digest_size=16).digest()


class VerifiedHeads:
    """Fingerprints of verified values by key, the `max_entries` most recent. Thread-safe."""

    def __init__(self, max_entries: int = 1 << 15) -> None:
        self.max_entries = max_entries
        self._prints: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, key: str, digest: bytes) -> None:
        with self._lock:
            self._prints[key] = digest
            self._prints.move_to_end(key)
            while len(self._prints) > self.max_entries:
                self._prints.popitem(last=False)

    def vouches(self, key: str, digest: bytes) -> bool:
        """True if the value of `key` with this fingerprint was verified (or written) here."""
        with self._lock:
            return self._prints.get(key) == digest

    def forget(self, key: str) -> None:
        with self._lock:
            self._prints.pop(key, None)

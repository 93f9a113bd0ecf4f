"""What a shared tier has verified in full: for each key, a fingerprint (length and first bytes) of the
value it last read and checked, or wrote itself, so `contains` can vouch for that value again without
fetching and checking all of it.

The first bytes hold the HMAC tag (signing.py) and the block header with its payload checksum
(serialization.py), so a different value — another key's, a forged one, one sealed under an old key — has
another fingerprint and is verified in full before `contains` counts it. A value altered behind an
unchanged head (only someone who can write to Redis can do that) is caught, and dropped, when it is read.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from promptcache.cache_store.serialization import HEADER_BYTES
from promptcache.cache_store.signing import SEAL_BYTES

HEAD_BYTES = SEAL_BYTES + HEADER_BYTES  # the seal (when signed) and the block header: tag and checksum


def fingerprint(length: int, head: bytes) -> bytes:
    """The fingerprint of a value `length` bytes long starting with `head` (its first HEAD_BYTES)."""
    return hashlib.blake2b(length.to_bytes(8, "little") + head, digest_size=16).digest()


class VerifiedHeads:
    """Fingerprints of verified values by key, the `max_entries` most recent (a forgotten one is only
    verified again). Thread-safe."""

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

"""Authenticated values in shared storage: an HMAC-SHA256 over (storage key, value) on everything written to
Redis, checked on read (docs/security.md). With a blob key set, a value without a valid tag (forged, altered,
sealed under a previous key, or replayed under another storage key) reads as absent and is logged."""

from __future__ import annotations

import hashlib
import hmac

from promptcache.cache_store.errors import logger

MAGIC = b"PCMAC1"  # marks a sealed value (and its format version)
TAG_BYTES = hashlib.sha256().digest_size
SEAL_BYTES = len(MAGIC) + TAG_BYTES  # what sealing puts in front of a value


class BlobSigner:
    """Seals values with HMAC-SHA256 under `key`; with no key, values pass through unchanged (and a
    sealed value read without a key is refused: it cannot be checked)."""

    def __init__(self, key: bytes | None = None) -> None:
        if key is not None and len(key) < 16:
            raise ValueError("the blob key must be at least 16 bytes")
        self._key = key

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def seal(self, storage_key: str, value: bytes) -> bytes:
        """`value` with its tag in front (unchanged when no key is set)."""
        return value if self._key is None else MAGIC + self._tag(storage_key, value) + value

    def open(self, storage_key: str, sealed: bytes) -> bytes | None:
        """The value if its tag checks out (or no key is set and the value is unsealed); None otherwise,
        with a warning: the caller treats it as a miss."""
        if self._key is None:
            if sealed.startswith(MAGIC):
                logger.warning("value at %s is signed but no blob key is set (PROMPTCACHE_BLOB_KEY); treating it "
                               "as absent", storage_key)
                return None
            return sealed
        if len(sealed) < SEAL_BYTES or not sealed.startswith(MAGIC):
            logger.warning("unsigned value at %s ignored (a blob key is set: every value must carry a tag)",
                           storage_key)
            return None
        tag, value = sealed[len(MAGIC):SEAL_BYTES], sealed[SEAL_BYTES:]
        if not hmac.compare_digest(tag, self._tag(storage_key, value)):
            logger.warning("value at %s failed its HMAC check (forged, altered, moved or sealed under "
                           "another key); treating it as absent", storage_key)
            return None
        return value

    def _tag(self, storage_key: str, value: bytes) -> bytes:
        assert self._key is not None
        key = storage_key.encode()
        mac = hmac.new(self._key, len(key).to_bytes(8, "little") + key, hashlib.sha256)
        mac.update(value)  # not concatenated: values are blobs of megabytes
        return mac.digest()

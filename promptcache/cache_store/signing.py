"""Authenticated values in shared storage: an HMAC-SHA256 over (storage key, value) on everything written to
Redis, checked on read (docs/security.md). With a blob key set, a value without a valid tag (forged, altered,
sealed under a previous key, or replayed under another storage key) reads as absent and is logged. A KV block is
sealed over its head only (header and table, `seal_head`): the table's SHA-256 digests carry the tag to every chunk,
so a reader may fetch and check a part of it (block_format.py)."""

from __future__ import annotations

import hashlib
import hmac

from promptcache.cache_store.errors import logger

MAGIC = b"PCMAC1"  # marks a sealed value (and its format version)
HEAD_MAGIC = b"PCMAC2"  # a value sealed over its first bytes (their count follows, u32)
TAG_BYTES = hashlib.sha256().digest_size
SEAL_BYTES = len(MAGIC) + TAG_BYTES  # what sealing puts in front of a value
HEAD_SEAL_BYTES = len(HEAD_MAGIC) + 4 + TAG_BYTES


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
            if sealed.startswith((MAGIC, HEAD_MAGIC)):
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

    def seal_head(self, storage_key: str, value: bytes, head_bytes: int) -> bytes:
        """`value` sealed over its first `head_bytes` only (a KV block's header and table); unchanged without a key."""
        if self._key is None:
            return value
        head = value[:head_bytes]
        return HEAD_MAGIC + head_bytes.to_bytes(4, "little") + self._tag(storage_key, head, prefix=True) + value

    def check_head(self, storage_key: str, seal: bytes, head: bytes) -> bool:
        """True if `seal` (a value's first HEAD_SEAL_BYTES) seals exactly `head` under this key."""
        if self._key is None or len(seal) < HEAD_SEAL_BYTES or not seal.startswith(HEAD_MAGIC):
            return False
        count = int.from_bytes(seal[len(HEAD_MAGIC): len(HEAD_MAGIC) + 4], "little")
        return count == len(head) and hmac.compare_digest(seal[len(HEAD_MAGIC) + 4: HEAD_SEAL_BYTES],
                                                          self._tag(storage_key, head, prefix=True))

    def open_block(self, storage_key: str, sealed: bytes) -> tuple[bytes, bool] | None:
        """(value, whether its tag covers only its head) for a KV block, as `open` checks it; None when refused."""
        if self._key is None or not sealed.startswith(HEAD_MAGIC):
            value = self.open(storage_key, sealed)
            return None if value is None else (value, False)
        seal, value = sealed[:HEAD_SEAL_BYTES], sealed[HEAD_SEAL_BYTES:]
        count = int.from_bytes(seal[len(HEAD_MAGIC): len(HEAD_MAGIC) + 4], "little")
        if not self.check_head(storage_key, seal, value[:count]):
            logger.warning("value at %s failed its HMAC check (forged, altered, moved or sealed under "
                           "another key); treating it as absent", storage_key)
            return None
        return value, True

    def _tag(self, storage_key: str, value: bytes, *, prefix: bool = False) -> bytes:
        assert self._key is not None
        key = storage_key.encode()
        mac = hmac.new(self._key, len(key).to_bytes(8, "little") + key, hashlib.sha256)
        if prefix:  # a head's tag never equals a whole value's: the domains differ
            mac.update(HEAD_MAGIC)
        mac.update(value)  # not concatenated: values are blobs of megabytes
        return mac.digest()

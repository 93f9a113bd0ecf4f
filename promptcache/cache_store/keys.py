"""Cache keys: SHA-256 over everything that determines a module's KV (design.md §4)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

# Part of the hashed input: bump it when the encoding below (or the KV it names) changes meaning,
# and every key made by an older build stops matching.
KEY_VERSION = "promptcache-kv-key/1"


def make_kv_key(*, model_fingerprint: str, tokenizer_fingerprint: str, token_ids: Sequence[int],
                position_ids: Sequence[int], context_digest: str, cache_salt: str | None = None) -> str:
    """The 64-hex-char key of one KV block.

    Every field is tagged and length-prefixed, so no two different inputs share an encoding (no collision
    by concatenation); `cache_salt=None` and `cache_salt=""` are different keys. Stable across processes
    and machines (never Python's `hash()`).
    """
    if len(token_ids) != len(position_ids):
        raise ValueError(f"{len(token_ids)} token ids but {len(position_ids)} position ids")
    digest = hashlib.sha256()
    _text(digest, KEY_VERSION)
    _text(digest, model_fingerprint)
    _text(digest, tokenizer_fingerprint)
    _ints(digest, token_ids)
    _ints(digest, position_ids)
    _text(digest, context_digest)
    if cache_salt is None:
        digest.update(b"\x00")
    else:
        digest.update(b"\x01")
        _text(digest, cache_salt)
    return digest.hexdigest()


def _text(digest: hashlib._Hash, text: str) -> None:
    data = text.encode("utf-8")
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)


def _ints(digest: hashlib._Hash, values: Sequence[int]) -> None:
    digest.update(len(values).to_bytes(8, "little"))
    digest.update(b"".join(int(v).to_bytes(8, "little", signed=True) for v in values))

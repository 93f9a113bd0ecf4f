"""Cache keys: SHA-256 over everything that determines a module's KV (design.md §4)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

KEY_VERSION = b"promptcache-kv-key-v1"


def make_kv_key(*, model_fingerprint: str, tokenizer_fingerprint: str, token_ids: Sequence[int],
                position_ids: Sequence[int], context_digest: str, cache_salt: str | None = None) -> str:
    """64 hex chars naming one KV block. Every field is length-prefixed so no two inputs collide by
    concatenation; the version tag invalidates old keys when the format changes."""
    h = hashlib.sha256(KEY_VERSION)
    for text in (model_fingerprint, tokenizer_fingerprint, context_digest,
                 "" if cache_salt is None else "salt:" + cache_salt):
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    for ints in (token_ids, position_ids):
        values = list(ints)
        h.update(len(values).to_bytes(8, "little"))
        for value in values:
            h.update(int(value).to_bytes(8, "little", signed=True))
    return h.hexdigest()

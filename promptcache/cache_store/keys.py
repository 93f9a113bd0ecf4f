"""Cache keys: SHA-256 over everything that determines a link's KV (docs/architecture.md).

One key function names every KV link (a module segment after its encoding context, or a prefix block after
its parent link); the parent goes in as `context_digest`, so a key covers the whole chain before it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

KEY_VERSION = b"promptcache-kv-key-v1"
CHAIN_ROOT_VERSION = b"promptcache-chain-root-v1"
OWNER_MARK = "\x00owner\x00"  # a client salt cannot contain NUL (the server refuses control characters)


def make_kv_key(*, model_fingerprint: str, tokenizer_fingerprint: str, token_ids: Sequence[int],
                position_ids: Sequence[int], context_digest: str, cache_salt: str | None = None) -> str:
    """64 hex chars naming one KV block. Every field is length-prefixed so no two inputs collide by
    concatenation; the version tag invalidates old keys when the format changes."""
    h = hashlib.sha256(KEY_VERSION)
    _update_texts(h, (model_fingerprint, tokenizer_fingerprint, context_digest,
                      "" if cache_salt is None else "salt:" + cache_salt))
    for ints in (token_ids, position_ids):
        values = list(ints)
        h.update(len(values).to_bytes(8, "little"))
        h.update(struct.pack(f"<{len(values)}q", *values))  # each value: 8 bytes, little-endian, signed
    return h.hexdigest()


def chain_root(link_keys: Sequence[str], *, variant: str = "") -> str:
    """The parent key of the first prefix block of a token stream: the digest of the keys of the module links
    before it, in order (none for a plain prompt). `variant` names anything else that changes what the
    stream's KV attends to (e.g. a fidelity mode), so such KV never shares keys with the plain reuse."""
    h = hashlib.sha256(CHAIN_ROOT_VERSION)
    _update_texts(h, (variant, *link_keys))
    return h.hexdigest()


def _update_texts(h: hashlib._Hash, texts: Sequence[str]) -> None:
    for text in texts:  # length-prefixed: no two text lists hash the same bytes
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little") + data)


def owned_salt(owner: str, salt: str | None) -> str:
    """A salt that scopes keys to `owner` (a tenant), with `salt` subdividing inside it. No salt without
    the mark can equal one with it. Only keys are made from it: whoever stores the KV is told its owner
    (for byte shares) as well."""
    return f"{OWNER_MARK}{owner}\x00{'' if salt is None else '+' + salt}"

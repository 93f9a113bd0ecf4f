"""KVBlock: the cached attention states of one token run, all layers; the keys naming them (block_format.py: their
binary format). A key is SHA-256 over everything that determines a link's KV (a module segment after its encoding
context, or a prefix block after its parent link, which goes in as `context_digest`: a key covers the whole chain
before it)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from promptcache.cache_store.errors import BlockMismatchError
from promptcache.cache_store.layer_reach import LayerReach


@dataclass(frozen=True, slots=True, eq=False)
class KVBlock:
    """Post-RoPE keys and values of `num_tokens` tokens for every layer, and their position ids. `present`: a block
    read in part (a ranged fetch for sliding-window layers) holds per layer only the tokens from its first token on,
    the rest zeros; None: all of it. Only a request the part covers may use it, and it is never written back."""

    keys: torch.Tensor          # [num_layers, num_kv_heads, num_tokens, head_dim]
    values: torch.Tensor        # [num_layers, num_kv_heads, num_tokens, head_dim]
    position_ids: torch.Tensor  # [num_tokens] int64
    present: LayerReach | None = None

    def __post_init__(self) -> None:
        if self.keys.dim() != 4 or self.keys.shape != self.values.shape:
            raise BlockMismatchError(f"keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} must be "
                                     "equal 4-D shapes [layers, kv_heads, tokens, head_dim]")
        if self.keys.dtype != self.values.dtype:
            raise BlockMismatchError(f"keys are {self.keys.dtype} but values are {self.values.dtype}")
        if self.position_ids.dim() != 1 or self.position_ids.dtype != torch.int64 \
                or self.position_ids.numel() != self.keys.shape[2]:
            raise BlockMismatchError(f"position_ids must be int64 [{self.keys.shape[2]}], got "
                                     f"{self.position_ids.dtype} {tuple(self.position_ids.shape)}")
        if self.present is not None and len(self.present.first_tokens) != self.keys.shape[0]:
            raise BlockMismatchError(f"a part present on {len(self.present.first_tokens)} layers of a "
                                     f"{self.keys.shape[0]}-layer block")

    def part(self, reach: LayerReach | None) -> KVBlock:
        """This block as the part `reach` reads (the same tensors; moved to another device, only that part is
        copied); itself when `reach` reads all of it or it is a part already."""
        if reach is None or reach.is_whole or self.present is not None:
            return self
        return KVBlock(self.keys, self.values, self.position_ids, reach)

    def serves(self, reach: LayerReach | None) -> bool:
        """True if this block holds every token a request reading `reach` (None: all of it) reads."""
        return self.present is None or self.present.covers(reach)

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return (self.keys.numel() * self.keys.element_size() * 2
                + self.position_ids.numel() * self.position_ids.element_size())

    @property
    def held_nbytes(self) -> int:
        """The bytes this block holds: `nbytes` less the KV a part read left out."""
        if self.present is None:
            return self.nbytes
        tokens = self.keys.shape[2]
        kv = self.keys.numel() * self.keys.element_size() * 2
        return self.nbytes - kv + self.present.share_of(kv, tokens)

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def to(self, device: torch.device | str, *, pin_memory: bool = False) -> KVBlock:
        """This block on `device` (self if already there); `pin_memory` for host copies of GPU data: one
        asynchronous copy straight into pinned memory (not two, through pageable memory), then waited for."""
        if torch.device(device) == self.keys.device and not pin_memory:
            return self
        if not pin_memory and self.present is not None:  # a part moves only what it holds
            keys, values = (torch.zeros(t.shape, dtype=t.dtype, device=device) for t in (self.keys, self.values))
            for layer, first in enumerate(self.present.first_tokens):
                keys[layer, :, first:].copy_(self.keys[layer, :, first:])
                values[layer, :, first:].copy_(self.values[layer, :, first:])
            return KVBlock(keys, values, self.position_ids.to("cpu"), self.present)
        if not pin_memory:
            return KVBlock(self.keys.to(device), self.values.to(device), self.position_ids.to("cpu"), self.present)
        keys, values = (torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                        for t in (self.keys, self.values))
        if self.keys.is_cuda:  # the host reads these (serialization, later copies): wait for the copies
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event() unannotated
            done.record(torch.cuda.current_stream(self.keys.device))
            done.synchronize()
        return KVBlock(keys, values, self.position_ids.to("cpu"), self.present)


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
        values = list(ints)  # each value: 8 bytes, little-endian, signed
        h.update(len(values).to_bytes(8, "little") + struct.pack(f"<{len(values)}q", *values))
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
    """A salt that scopes keys to `owner` (a tenant), with `salt` subdividing inside it; no salt without the mark
    equals one with it. Only keys are made from it: whoever stores the KV is told its owner too (byte shares)."""
    return f"{OWNER_MARK}{owner}\x00{'' if salt is None else '+' + salt}"

"""BlockIndex: automatic prefix reuse as chains of fixed-size KV blocks in the tiered store (docs/architecture.md).
A token stream is cut into blocks of `block_size` tokens, each keyed (like module KV) by its parent's key, its
tokens and positions. A request reuses the longest chain of stored blocks; where its tokens diverge inside a
block, a stored sibling sharing a prefix with them donates that prefix, so reuse is token-exact. For a model with
sliding-window layers, a block wholly used is fetched only as far as a window still reaches it from the request's
first query (layer_reach.py): taken to follow the whole match first, and where the match ends sooner, the blocks then
in reach are fetched again. A block used in part is fetched whole: its KV is copied into the block the request
stores in its place."""

from __future__ import annotations

import itertools
import operator
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from promptcache.cache_store.block import KVBlock, make_kv_key
from promptcache.cache_store.layer_reach import LayerReach, window_reach
from promptcache.cache_store.tier import BlockKind, Tier

# Returns keys and values [num_layers, num_kv_heads, end - start, head_dim] of stream tokens [start, end).
KVGather = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class BlockIndexConfig:
    """`block_size` tokens per block; `ttl_s` bounds how long an unused block lives (None: LRU only);
    `max_children` bounds the in-memory map used for partial-block reuse (~0.8 KB per block of 32)."""

    block_size: int = 32
    ttl_s: float | None = None
    max_children: int = 65_536

    def __post_init__(self) -> None:
        if not 1 <= self.block_size <= 4096:
            raise ValueError(f"block_size must be in [1, 4096], got {self.block_size}")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {self.ttl_s}")
        if self.max_children < 0:
            raise ValueError(f"max_children must be >= 0, got {self.max_children}")


@dataclass(frozen=True, slots=True)
class Link:
    """A stored block reused for stream tokens [start, start + num_tokens) (a prefix of the block)."""

    key: str
    start: int
    num_tokens: int
    block: KVBlock  # sliced to num_tokens (a view); a part (KVBlock.present) where windows reach only its tail
    tier: str
    is_whole: bool  # the whole stored block is used (not only a prefix of it)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True, slots=True)
class Match:
    """The longest reusable prefix of a stream: consecutive links from token 0."""

    links: tuple[Link, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.links[-1].end if self.links else 0


class BlockStore(Protocol):
    """What BlockIndex needs of a store: TieredStore, or the runtime's KVStore view of it."""

    def get(self, key: str, *, num_tokens: int | None = None, nbytes: int | None = None,
            reach: LayerReach | None = None) -> tuple[KVBlock, str] | None: ...

    def put(self, key: str, block: KVBlock, *, ttl_s: float | None = None, kind: BlockKind = "module",
            owner: str | None = None) -> None: ...

    def tier_of(self, key: str) -> Tier | None: ...

    def touch(self, keys: Iterable[str]) -> None: ...


class BlockIndex:
    """Finds and stores the prefix blocks of token streams. Thread-safe; KV lives in `store`. `windows`: the model's
    sliding window per layer (None: full attention), so a match fetches what they reach."""

    def __init__(self, store: BlockStore, config: BlockIndexConfig, *, model_fingerprint: str,
                 tokenizer_fingerprint: str, bytes_per_token: int, windows: tuple[int | None, ...] = ()) -> None:
        self.store = store
        self.windows = windows
        self.config = config
        self.model_fingerprint = model_fingerprint
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.bytes_per_token = bytes_per_token
        # parent -> {child key: packed (token id, position) pairs} in LRU order (tuples cost ~3 KB per block).
        self._children: OrderedDict[str, dict[str, bytes]] = OrderedDict()
        self._num_children = 0
        self._lock = threading.Lock()

    def key(self, parent: str, token_ids: Sequence[int], position_ids: Sequence[int], salt: str | None) -> str:
        return make_kv_key(model_fingerprint=self.model_fingerprint, tokenizer_fingerprint=self.tokenizer_fingerprint,
                           token_ids=token_ids, position_ids=position_ids, context_digest=parent, cache_salt=salt)

    def match(self, root: str, token_ids: Sequence[int], position_ids: Sequence[int], *, salt: str | None,
              max_tokens: int) -> Match:
        """Fetch (and promote) the longest stored prefix of the stream, at most `max_tokens` tokens long; a
        caller should `store.acquire` their keys while they are in use."""
        limit = min(max_tokens, len(token_ids))
        links: list[Link] = []
        # The request's queries lie at or after the lowest position of the tokens the match leaves: guessed as if it
        # covered `limit` tokens, corrected below where it does not.
        first_after = _suffix_minima(position_ids) if any(w is not None for w in self.windows) else []
        guess = first_after[limit] if limit < len(first_after) else None
        for parent, key, start, ids, pos in self._chain(root, token_ids, position_ids, salt, limit):
            used = min(len(ids), limit - start)
            reach = None if guess is None or used < len(ids) else window_reach(self.windows, pos, guess)
            link = self._fetch(key, start, used, reach)
            if link is None:  # a stored sibling block sharing a prefix with `ids`: its first tokens are ours too
                donor = self._best_child(_family(parent, salt), ids, pos)
                link = None if donor is None else self._fetch(donor[0], start, min(donor[1], limit - start))
            if link is not None:
                links.append(link)
            if link is None or link.num_tokens < len(ids):
                break
        while guess is not None and links and links[-1].end < limit:  # the match ended sooner than guessed
            widened = self._widen(links, first_after)  # what its first query reaches, fetched again
            if widened is None:
                break
            links = widened
        self.store.touch(link.key for link in reversed(links))  # keep the chain's root the most recent
        return Match(tuple(links))

    def _widen(self, links: list[Link], first_after: list[int]) -> list[Link] | None:
        """`links` with each part that the first query after the last link reaches beyond fetched again (cut before
        one no tier gives any more); None when every part holds what it reaches."""
        first, widened, changed = first_after[links[-1].end], list(links), False
        for index, link in enumerate(links):
            if link.block.present is None:
                continue
            reach = window_reach(self.windows, link.block.position_ids.tolist(), first)
            if link.block.serves(reach):
                continue
            changed = True
            refetched = self._fetch(link.key, link.start, link.num_tokens, reach)
            if refetched is None:
                return widened[:index]
            widened[index] = refetched
        return widened if changed else None

    def peek(self, root: str, token_ids: Sequence[int], position_ids: Sequence[int], *,
             salt: str | None) -> list[tuple[str, int]]:
        """(tier, num_tokens) for each block `match` would reuse, without fetching anything."""
        found: list[tuple[str, int]] = []
        for parent, key, _, ids, pos in self._chain(root, token_ids, position_ids, salt, len(token_ids)):
            tier = self.store.tier_of(key)
            if tier is None:
                donor = self._best_child(_family(parent, salt), ids, pos)
                tier = self.store.tier_of(donor[0]) if donor is not None else None
                if donor is not None and tier is not None:
                    found.append((tier.name, donor[1]))
                break
            found.append((tier.name, len(ids)))
        return found

    def insert(self, root: str, token_ids: Sequence[int], position_ids: Sequence[int], gather: KVGather, *,
               salt: str | None, owner: str | None = None, stored_upto: int = 0) -> int:
        """Store the stream's blocks from token `stored_upto` on (the end of the full blocks already stored),
        counted against `owner`'s byte share; the last may be partial. Returns the new `stored_upto`."""
        size, n = self.config.block_size, len(token_ids)
        assert stored_upto % size == 0, "stored_upto must end a full block"
        chain = list(self._chain(root, token_ids, position_ids, salt, n))
        # Leaf first: the last put is the most recently used, so LRU evicts a chain from its leaves.
        for parent, key, start, ids, pos in reversed(chain):
            if start >= stored_upto:
                keys, values = gather(start, start + len(ids))
                block = KVBlock(keys, values, torch.tensor(pos, dtype=torch.long))
                self.store.put(key, block, ttl_s=self.config.ttl_s, kind="prefix", owner=owner)
                self._remember(_family(parent, salt), key, ids, pos)
        self.store.touch(key for _, key, *_ in reversed(chain))
        return n - n % size

    def _chain(self, root: str, token_ids: Sequence[int], position_ids: Sequence[int], salt: str | None,
               end: int) -> Iterator[tuple[str, str, int, tuple[int, ...], tuple[int, ...]]]:
        """(parent, key, start, ids, pos) of each block of the stream that starts before token `end`."""
        size, parent = self.config.block_size, root
        for start in range(0, end, size):
            ids, pos = tuple(token_ids[start: start + size]), tuple(position_ids[start: start + size])
            key = self.key(parent, ids, pos, salt)
            yield parent, key, start, ids, pos
            parent = key

    def _fetch(self, key: str, start: int, num_tokens: int, reach: LayerReach | None = None) -> Link | None:
        size = self.config.block_size
        nbytes = size * self.bytes_per_token
        if reach is not None:  # a part costs its share of the bytes
            nbytes = reach.share_of(nbytes, size)
        if (hit := self.store.get(key, num_tokens=size, nbytes=nbytes, reach=reach)) is None:
            return None
        block, tier = hit
        used = min(num_tokens, block.num_tokens)
        is_whole = used == block.num_tokens
        if not is_whole:
            block = KVBlock(block.keys[:, :, :used], block.values[:, :, :used], block.position_ids[:used])
        return Link(key, start, used, block, tier, is_whole)

    def _best_child(self, parent: str, ids: tuple[int, ...], pos: tuple[int, ...]) -> tuple[str, int] | None:
        with self._lock:
            children = self._children.get(parent)
            if not children:
                return None
            self._children.move_to_end(parent)
            candidates = list(children.items())
        ours = _pack(ids, pos)
        common, key = max(((_common_prefix(packed, ours), key) for key, packed in candidates), key=lambda c: c[0])
        return (key, common) if common else None

    def _remember(self, parent: str, key: str, ids: tuple[int, ...], pos: tuple[int, ...]) -> None:
        if self.config.max_children == 0:
            return
        with self._lock:
            children = self._children.setdefault(parent, {})
            self._children.move_to_end(parent)
            if key not in children:
                children[key] = _pack(ids, pos)
                self._num_children += 1
            while self._num_children > self.config.max_children:
                _, dropped = self._children.popitem(last=False)
                self._num_children -= len(dropped)


def _family(parent: str, salt: str | None) -> str:
    """Children are looked up per (parent, salt): a root is shared by every salt, its blocks are not."""
    return parent if salt is None else f"{parent}/{salt}"


def _pack(ids: Sequence[int], pos: Sequence[int]) -> bytes:
    """Token ids and positions as interleaved int32 pairs: id0, pos0, id1, pos1, ..."""
    pairs = array("i", bytes(8 * len(ids)))
    pairs[0::2], pairs[1::2] = array("i", ids), array("i", pos)
    return pairs.tobytes()


def _common_prefix(a: bytes, b: bytes) -> int:
    """How many leading (id, position) pairs two packed blocks share (a binary search, each test one memcmp)."""
    low, high = 0, min(len(a), len(b)) // 8  # a[:8*low] == b[:8*low] holds; find the largest such low
    while low < high:
        mid = (low + high + 1) // 2
        if a[:8 * mid] == b[:8 * mid]:
            low = mid
        else:
            high = mid - 1
    return low


def _suffix_minima(position_ids: Sequence[int]) -> list[int]:
    """Per index i, the lowest of position_ids[i:] (a stream's positions need not ascend: recomputed module tokens)."""
    if all(map(operator.lt, position_ids, itertools.islice(position_ids, 1, None))):
        return list(position_ids)  # ascending (the usual stream): each is its own suffix's lowest
    return list(itertools.accumulate(reversed(position_ids), min))[::-1]

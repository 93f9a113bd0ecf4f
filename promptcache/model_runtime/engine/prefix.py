"""Automatic prefix reuse: a request's token *stream* (new tokens, then generated ones, under a chain root naming the
module links it attends) is looked up at admission, its blocks stored after the prefill and each finished sample.
`LogitsCache` keeps last-token logits, so an exact repeat whose blocks cover every token runs no pass first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from promptcache.cache_store import BlockIndex, Match, chain_root


class KVView(NamedTuple):
    """Which KV a shared block is: tokens [first, last) of the block stored under `key` (None: to its end), keys moved
    by `shift` when attended; a view not whole is a distinct tensor, held under its key. `part`: a block fetched in part
    (KVBlock.present: per layer its first token held), another tensor than the block read whole or in another part."""

    key: str
    first: int = 0
    last: int | None = None
    shift: int = 0
    part: tuple[int, ...] | None = None

    @property
    def is_whole(self) -> bool:
        return self.first == 0 and self.last is None and self.shift == 0

    def order(self) -> tuple[str, int, bool, int, int, tuple[int, ...]]:
        """A total order of views (for sorting): one to the block's end before any range ending earlier."""
        return self.key, self.first, self.last is not None, self.last or 0, self.shift, self.part or ()


# A run of the stream's KV: (first stream index, keys, values), tensors [L, H_kv, n, D] (views).
KVPiece = tuple[int, torch.Tensor, torch.Tensor]


@dataclass(eq=False)
class Stream:
    """One request's stream: tokens and positions of its prompt part, what was reused, what is stored."""

    root: str
    token_ids: list[int]
    position_ids: list[int]
    match: Match = field(default_factory=Match)
    prompt_pieces: list[KVPiece] = field(default_factory=list)  # KV of every prompt token, after prefill
    stored_upto: int = 0  # stream tokens covered by full blocks already in the store
    logits: torch.Tensor | None = None  # [vocab]: cached logits of the last token when every token is reused

    @property
    def num_reused(self) -> int:
        return self.match.num_tokens


class LogitsCache:
    """Last-token logits of recently prefilled streams, by stream key, LRU within a byte budget (engine thread)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0

    def get(self, key: str) -> torch.Tensor | None:
        logits = self._entries.get(key)
        if logits is not None:
            self._entries.move_to_end(key)
        return logits

    def contains(self, key: str) -> bool:
        return key in self._entries

    def put(self, key: str, logits: torch.Tensor) -> None:
        nbytes = logits.numel() * logits.element_size()
        if nbytes > self.max_bytes or key in self._entries:
            return
        self._entries[key] = logits
        self._bytes += nbytes
        while self._bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.numel() * dropped.element_size()


class PrefixReuse:
    """The engine's view of the block index (None: no prefix reuse); `logits_cache_bytes` 0: no LogitsCache."""

    def __init__(self, index: BlockIndex | None, logits_cache_bytes: int = 0) -> None:
        self.index = index
        self.logits = LogitsCache(logits_cache_bytes) if index is not None and logits_cache_bytes > 0 else None

    def open(self, module_keys: list[str], token_ids: list[int], position_ids: list[int], *,
             salt: str | None, variant: str = "", match: bool = True) -> Stream:
        """A stream with its longest stored prefix fetched (none unless `match`). The last token is left to
        compute for its logits unless they are cached and stored blocks cover every token (`stream.logits`)."""
        stream = Stream(chain_root(module_keys, variant=variant), list(token_ids), list(position_ids))
        if self.index is not None and token_ids and match:
            logits = self.logits.get(self._terminal_key(stream, salt)) if self.logits is not None else None
            limit = len(token_ids) if logits is not None else len(token_ids) - 1
            stream.match = self.index.match(stream.root, token_ids, position_ids, salt=salt, max_tokens=limit)
            if stream.match.num_tokens == len(token_ids):
                stream.logits = logits
            size = self.index.config.block_size
            stream.stored_upto = sum(1 for link in stream.match.links if link.num_tokens == size) * size
        return stream

    def remember_logits(self, stream: Stream, logits: torch.Tensor, *, salt: str | None) -> None:
        """Keep the logits of the stream's last prompt token (`logits` [vocab], after its prefill)."""
        if self.logits is not None and stream.token_ids:
            self.logits.put(self._terminal_key(stream, salt), logits.detach().float().cpu().clone())

    def _terminal_key(self, stream: Stream, salt: str | None) -> str:
        assert self.index is not None
        return self.index.key(stream.root, stream.token_ids, stream.position_ids, salt)

    def peek(self, module_keys: list[str], token_ids: list[int], position_ids: list[int], *,
             salt: str | None, variant: str = "") -> list[tuple[str, int]]:
        """(tier, tokens) of the blocks `open` would reuse, without fetching them."""
        if self.index is None or not token_ids:
            return []
        root = chain_root(module_keys, variant=variant)
        found = self.index.peek(root, token_ids, position_ids, salt=salt)
        whole = self.logits is not None and self.logits.contains(
            self._terminal_key(Stream(root, list(token_ids), list(position_ids)), salt))
        limit, result = len(token_ids) - (0 if whole else 1), []
        for tier, count in found:  # `open` leaves the last token to compute (unless its logits are cached)
            count = min(count, limit)
            if count > 0:
                result.append((tier, count))
            limit -= count
        return result

    def store_prompt(self, stream: Stream, computed: KVPiece, *, salt: str | None, owner: str | None) -> None:
        """Store the prompt's blocks for `owner` once its `computed` part exists; keeps its pieces for store_sample."""
        stream.prompt_pieces = [(link.start, link.block.keys, link.block.values) for link in stream.match.links]
        stream.prompt_pieces.append(computed)
        if self.index is None:
            return
        stream.stored_upto = self.index.insert(stream.root, stream.token_ids, stream.position_ids,
                                               _gather(stream.prompt_pieces), salt=salt, owner=owner,
                                               stored_upto=stream.stored_upto)

    def store_sample(self, stream: Stream, output_ids: list[int], first_position: int, generated: KVPiece, *,
                     salt: str | None, owner: str | None) -> None:
        """Store the blocks of prompt + generated text for `owner` (the last sampled token, never fed, has no KV)."""
        if self.index is None or not stream.prompt_pieces or len(output_ids) < 2:
            return
        fed = output_ids[:-1]
        token_ids = stream.token_ids + fed
        position_ids = stream.position_ids + list(range(first_position, first_position + len(fed)))
        self.index.insert(stream.root, token_ids, position_ids, _gather([*stream.prompt_pieces, generated]),
                          salt=salt, owner=owner, stored_upto=stream.stored_upto)


def _gather(pieces: list[KVPiece]):
    """KV of stream tokens [start, end) copied out of the pieces that cover them."""

    def gather(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = [], []
        for first, piece_keys, piece_values in pieces:
            last = first + piece_keys.shape[2]
            lo, hi = max(start, first), min(end, last)
            if lo < hi:
                keys.append(piece_keys[:, :, lo - first: hi - first])
                values.append(piece_values[:, :, lo - first: hi - first])
        covered = sum(k.shape[2] for k in keys)
        assert covered == end - start, f"stream KV [{start}, {end}) covered by {covered} tokens"
        # torch.cat copies: a stored block owns its memory and never pins a request's buffer.
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    return gather

"""The layout of a version-3 KV block blob (block_format.py writes and reads it): where its header, chunk table,
position ids and each layer's keys and values lie, and the digests that check each chunk on its own."""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import xxhash

from promptcache.cache_store.block import KVBlock
from promptcache.cache_store.errors import BlockMismatchError, CorruptBlockError
from promptcache.cache_store.layer_reach import LayerReach

MAGIC = b"PCKV"
VERSION = 3
DIGEST_BYTES = 16
XXH3, SHA256 = 1, 2  # digest codes
_HASHERS: dict[int, Callable[[], object]] = {XXH3: xxhash.xxh3_128, SHA256: hashlib.sha256}
HEADER = struct.Struct("<4sHBB64s4IIQ32s")
HEADER_BYTES = HEADER.size
DTYPES = {1: torch.float32, 2: torch.float16, 3: torch.bfloat16}
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}
_ELEMENT_BYTES = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in DTYPES.values()}

Ranges = list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a version-3 blob keeps what; offsets count from the blob's first byte."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, int, int, int]  # layers, kv_heads, tokens, head_dim
    chunk_tokens: int
    digest_code: int
    payload_length: int
    table_digest: bytes
    head_bytes: int = field(init=False)  # header and table: what a signed store's seal covers
    positions_bytes: int = field(init=False)
    tensor_bytes: int = field(init=False)
    _row_bytes: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        layers, _, tokens, dim = self.shape
        num_chunks = math.ceil(tokens / self.chunk_tokens)
        derived = {"head_bytes": HEADER_BYTES + (2 * layers * num_chunks + 1) * DIGEST_BYTES,
                   "positions_bytes": tokens * 8, "tensor_bytes": math.prod(self.shape) * _ELEMENT_BYTES[self.dtype],
                   "_row_bytes": dim * _ELEMENT_BYTES[self.dtype]}
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @classmethod
    def parse(cls, header: bytes | bytearray | memoryview) -> Layout:
        """The layout a version-3 header states; CorruptBlockError if it is not a sound one."""
        magic, version, code, digest_code, key, *shape, chunk, length, digest = HEADER.unpack_from(header)
        if magic != MAGIC:
            raise CorruptBlockError(f"bad magic {magic!r}")
        if version != VERSION or code not in DTYPES or digest_code not in _HASHERS or chunk == 0:
            raise CorruptBlockError(f"unsound version-3 header (dtype {code}, digest {digest_code}, chunk {chunk})")
        layout = cls(key.rstrip(b"\0").decode("ascii"), DTYPES[code], tuple(shape), chunk, digest_code, length,
                     bytes(digest[:DIGEST_BYTES]))
        if layout.positions_bytes + 2 * layout.tensor_bytes != length:
            raise CorruptBlockError("shape does not match payload length")
        return layout

    @property
    def num_chunks(self) -> int:
        return math.ceil(self.shape[2] / self.chunk_tokens)

    @property
    def total_bytes(self) -> int:
        return self.head_bytes + self.payload_length

    def same_shape(self, other: Layout) -> bool:
        """True if `other` lays its bytes out as this one does (key and digests aside)."""
        return (self.dtype, self.shape, self.chunk_tokens, self.digest_code, self.payload_length) == \
            (other.dtype, other.shape, other.chunk_tokens, other.digest_code, other.payload_length)

    def kept(self, reach: LayerReach | None) -> tuple[int, ...]:
        """Per layer, the first token a read for `reach` fetches: its first token's chunk."""
        tokens = self.shape[2]
        if reach is None:
            return (0,) * self.shape[0]
        if len(reach.first_tokens) != self.shape[0]:
            raise BlockMismatchError(f"a reach over {len(reach.first_tokens)} layers for a {self.shape[0]}-layer block")
        return tuple(tokens if t >= tokens else t // self.chunk_tokens * self.chunk_tokens for t in reach.first_tokens)

    def ranges(self, kept: Sequence[int]) -> Ranges:
        """The byte ranges of the KV a read keeping `kept` fetches, adjacent ones joined."""
        ranges: Ranges = []
        for tensor, layer, head in self._rows():
            if kept[layer] < self.shape[2]:
                start, stop = self.span(tensor, layer, head, kept[layer], self.shape[2])
                if ranges and ranges[-1][1] == start:
                    ranges[-1] = (ranges[-1][0], stop)
                else:
                    ranges.append((start, stop))
        return ranges

    def check(self, blob: bytes | bytearray | memoryview, kept: Sequence[int]) -> None:
        """Verify the table and every chunk from `kept` on (the whole block: zeros) in `blob`, an image of the
        stored value (bytes not fetched may be anything)."""
        view = memoryview(blob)
        table = view[HEADER_BYTES: self.head_bytes]
        if self.digest([table]) != self.table_digest:
            raise CorruptBlockError("checksum mismatch (table)")
        positions = self.head_bytes, self.head_bytes + self.positions_bytes
        if self.digest([view[slice(*positions)]]) != table[-DIGEST_BYTES:]:
            raise CorruptBlockError("checksum mismatch (positions)")
        for index, (tensor, layer, chunk) in enumerate(self.chunks()):
            first = chunk * self.chunk_tokens
            if first < kept[layer]:
                continue
            last = min(first + self.chunk_tokens, self.shape[2])
            pieces = [view[slice(*self.span(tensor, layer, h, first, last))] for h in range(self.shape[1])]
            if self.digest(pieces) != table[index * DIGEST_BYTES: (index + 1) * DIGEST_BYTES]:
                raise CorruptBlockError(f"checksum mismatch ({'keys' if tensor == 0 else 'values'} of layer {layer})")

    def block(self, blob: bytearray, kept: Sequence[int]) -> KVBlock:
        """The block in `blob` (an image of the whole value, checked), owning its memory."""
        shape, start = self.shape, self.head_bytes
        present = None if not any(kept) else LayerReach(tuple(kept))
        return KVBlock(buffer_tensor(blob, self.dtype, shape, start + self.positions_bytes),
                       buffer_tensor(blob, self.dtype, shape, start + self.positions_bytes + self.tensor_bytes),
                       buffer_tensor(blob, torch.int64, (shape[2],), start), present)

    def _rows(self) -> Iterator[tuple[int, int, int]]:
        for tensor in (0, 1):
            for layer in range(self.shape[0]):
                for head in range(self.shape[1]):
                    yield tensor, layer, head

    def chunks(self) -> Iterator[tuple[int, int, int]]:
        """(tensor, layer, chunk) in table order."""
        for tensor in (0, 1):
            for layer in range(self.shape[0]):
                for chunk in range(self.num_chunks):
                    yield tensor, layer, chunk

    def span(self, tensor: int, layer: int, head: int, first: int, last: int) -> tuple[int, int]:
        """The bytes of tokens [first, last) of one head of one layer of keys (0) or values (1)."""
        _, heads, tokens, _ = self.shape
        row = self._row_bytes
        base = self.head_bytes + self.positions_bytes + tensor * self.tensor_bytes
        base += (layer * heads + head) * tokens * row
        return base + first * row, base + last * row

    def digest(self, pieces: Sequence[memoryview]) -> bytes:
        hasher = _HASHERS[self.digest_code]()
        for piece in pieces:
            hasher.update(piece)  # type: ignore[attr-defined]  # xxh3_128 and sha256 both have update/digest
        return hasher.digest()[:DIGEST_BYTES]  # type: ignore[attr-defined, no-any-return]


def buffer_tensor(buffer: bytearray, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """`shape` of `dtype` over `buffer` from byte `offset` (owning no copy)."""
    if (count := math.prod(shape)) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)

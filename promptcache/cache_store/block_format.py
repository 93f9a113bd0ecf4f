"""The binary format of a KVBlock, whole or read in part.

Version 3, written (little endian): header = magic "PCKV" | u16 version | u8 dtype code | u8 digest code | 64-byte key
(ascii hex, zero-padded) | 4 x u32 shape (layers, kv_heads, tokens, head_dim) | u32 chunk tokens | u64 payload length |
32-byte digest of the table; table = for keys then values, per layer, per chunk of `chunk tokens` tokens, the 16-byte
digest of that chunk (its heads' rows in order), then the digest of the position ids; payload = position ids (int64) +
keys + values, each [layers, kv_heads, tokens, head_dim]. Every chunk verifies on its own, so a reader may fetch only
some layers' last tokens (what a sliding window still reaches, layer_reach.py) and check all it reads. Digests are
XXH3-128 (damage only; ~18 GB/s here) or, in a signed store, SHA-256 cut to 16 bytes: the seal then covers the header
and table alone (signing.py), and the digests carry it to every chunk. Versions 1 (one blake2b-256 of the payload)
and 2 (one XXH3-128), whose header lacks the chunk tokens, are still read whole."""

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
CHUNK_TOKENS = 64
DIGEST_BYTES = 16
XXH3, SHA256 = 1, 2  # digest codes
_HASHERS: dict[int, Callable[[], object]] = {XXH3: xxhash.xxh3_128, SHA256: hashlib.sha256}
_OLD_CHECKSUMS = {  # versions 1 and 2: one digest of the payload, as stored in the 32-byte field
    1: lambda payload: hashlib.blake2b(payload, digest_size=32).digest(),
    2: lambda payload: xxhash.xxh3_128(payload).digest().ljust(32, b"\0"),
}
_OLD_HEADER = struct.Struct("<4sHBB64s4IQ32s")
_HEADER = struct.Struct("<4sHBB64s4IIQ32s")
HEADER_BYTES = _HEADER.size
_DTYPES = {1: torch.float32, 2: torch.float16, 3: torch.bfloat16}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}
_ELEMENT_BYTES = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _DTYPES.values()}

Ranges = list[tuple[int, int]]
Reader = Callable[[Ranges], list[bytes]]  # the bytes of each (start, stop) range of a stored value


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
        magic, version, code, digest_code, key, *shape, chunk, length, digest = _HEADER.unpack_from(header)
        if magic != MAGIC:
            raise CorruptBlockError(f"bad magic {magic!r}")
        if version != VERSION or code not in _DTYPES or digest_code not in _HASHERS or chunk == 0:
            raise CorruptBlockError(f"unsound version-3 header (dtype {code}, digest {digest_code}, chunk {chunk})")
        layout = cls(key.rstrip(b"\0").decode("ascii"), _DTYPES[code], tuple(shape), chunk, digest_code, length,
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
                start, stop = self._span(tensor, layer, head, kept[layer], self.shape[2])
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
        if self._digest([table]) != self.table_digest:
            raise CorruptBlockError("checksum mismatch (table)")
        positions = self.head_bytes, self.head_bytes + self.positions_bytes
        if self._digest([view[slice(*positions)]]) != table[-DIGEST_BYTES:]:
            raise CorruptBlockError("checksum mismatch (positions)")
        for index, (tensor, layer, chunk) in enumerate(self._chunks()):
            first = chunk * self.chunk_tokens
            if first < kept[layer]:
                continue
            last = min(first + self.chunk_tokens, self.shape[2])
            pieces = [view[slice(*self._span(tensor, layer, h, first, last))] for h in range(self.shape[1])]
            if self._digest(pieces) != table[index * DIGEST_BYTES: (index + 1) * DIGEST_BYTES]:
                raise CorruptBlockError(f"checksum mismatch ({'keys' if tensor == 0 else 'values'} of layer {layer})")

    def block(self, blob: bytearray, kept: Sequence[int]) -> KVBlock:
        """The block in `blob` (an image of the whole value, checked), owning its memory."""
        shape, start = self.shape, self.head_bytes
        present = None if not any(kept) else LayerReach(tuple(kept))
        return KVBlock(_tensor(blob, self.dtype, shape, start + self.positions_bytes),
                       _tensor(blob, self.dtype, shape, start + self.positions_bytes + self.tensor_bytes),
                       _tensor(blob, torch.int64, (shape[2],), start), present)

    def _rows(self) -> Iterator[tuple[int, int, int]]:
        for tensor in (0, 1):
            for layer in range(self.shape[0]):
                for head in range(self.shape[1]):
                    yield tensor, layer, head

    def _chunks(self) -> Iterator[tuple[int, int, int]]:
        """(tensor, layer, chunk) in table order."""
        for tensor in (0, 1):
            for layer in range(self.shape[0]):
                for chunk in range(self.num_chunks):
                    yield tensor, layer, chunk

    def _span(self, tensor: int, layer: int, head: int, first: int, last: int) -> tuple[int, int]:
        """The bytes of tokens [first, last) of one head of one layer of keys (0) or values (1)."""
        _, heads, tokens, _ = self.shape
        row = self._row_bytes
        base = self.head_bytes + self.positions_bytes + tensor * self.tensor_bytes
        base += (layer * heads + head) * tokens * row
        return base + first * row, base + last * row

    def _digest(self, pieces: Sequence[memoryview]) -> bytes:
        hasher = _HASHERS[self.digest_code]()
        for piece in pieces:
            hasher.update(piece)  # type: ignore[attr-defined]  # xxh3_128 and sha256 both have update/digest
        return hasher.digest()[:DIGEST_BYTES]  # type: ignore[attr-defined, no-any-return]


def dumps(block: KVBlock, key: str = "", *, secure: bool = False) -> bytes:
    """Serialize `block` (stored under `key`) in version 3; `secure`: SHA-256 chunk digests (a signed store)."""
    if block.dtype not in _CODES:
        raise BlockMismatchError(f"cannot serialize dtype {block.dtype}; supported: {list(_CODES)}")
    if block.present is not None:
        raise BlockMismatchError("a block read in part is never stored: it lacks KV other requests read")
    payload = b"".join(map(_raw, (block.position_ids.to(torch.int64), block.keys, block.values)))
    layout = Layout(key, block.dtype, tuple(block.keys.shape), CHUNK_TOKENS,  # type: ignore[arg-type]  # 4-D
                    SHA256 if secure else XXH3, len(payload), b"")
    view, shift = memoryview(payload), layout.head_bytes  # spans count from the blob's start, the head's after it

    def span(tensor: int, layer: int, head: int, chunk: int) -> memoryview:
        start, stop = layout._span(tensor, layer, head, chunk * CHUNK_TOKENS,
                                   min((chunk + 1) * CHUNK_TOKENS, layout.shape[2]))
        return view[start - shift: stop - shift]

    heads = range(layout.shape[1])
    digests = [layout._digest([span(t, layer, h, c) for h in heads]) for t, layer, c in layout._chunks()]
    table = b"".join(digests) + layout._digest([view[:layout.positions_bytes]])
    header = _HEADER.pack(MAGIC, VERSION, _CODES[block.dtype], layout.digest_code, key.encode("ascii").ljust(64, b"\0"),
                          *block.keys.shape, CHUNK_TOKENS, len(payload),
                          layout._digest([memoryview(table)]).ljust(32, b"\0"))
    return header + table + payload


def version_of(data: bytes | bytearray | memoryview) -> int:
    """The format version a blob states (CorruptBlockError if it is not a block)."""
    if len(data) < _OLD_HEADER.size:
        raise CorruptBlockError(f"blob of {len(data)} bytes is shorter than the {_OLD_HEADER.size}-byte header")
    if bytes(data[:4]) != MAGIC:
        raise CorruptBlockError(f"bad magic {bytes(data[:4])!r}")
    return int.from_bytes(data[4:6], "little")


def loads(data: bytes | bytearray | memoryview, *, expect_key: str | None = None, secure: bool = False) -> KVBlock:
    """Parse and verify a whole blob; CorruptBlockError if damaged, BlockMismatchError if it is another key's.
    `secure`: the blob's seal covered only its head (signing.py), so its chunks must carry SHA-256 digests."""
    version = version_of(data)
    if version in _OLD_CHECKSUMS:
        if secure:
            raise CorruptBlockError(f"a version-{version} blob under a head-only seal")
        return _loads_old(data, expect_key)
    if version != VERSION:
        raise CorruptBlockError(f"unsupported format version {version} (this build reads 1, 2 and {VERSION})")
    if len(data) < HEADER_BYTES:
        raise CorruptBlockError(f"blob of {len(data)} bytes is shorter than the {HEADER_BYTES}-byte header")
    layout = _layout(data, expect_key, secure)
    if len(data) != layout.total_bytes:
        raise CorruptBlockError(f"blob is {len(data)} bytes, its header says {layout.total_bytes}")
    kept = (0,) * layout.shape[0]
    layout.check(data, kept)
    return layout.block(bytearray(data), kept)


def read_part(read: Reader, reach: LayerReach | None, *, expect_key: str, base: int = 0, secure: bool = False,
              check_head: Callable[[bytes], bool] | None = None, guess: Layout | None = None) -> KVBlock | None:
    """Read from a stored value, through `read`, only what `reach` reads of the version-3 blob at offset `base`
    (None: not version 3, read it whole). `read` is called for the header, then for the table, position ids and KV
    ranges; with a `guess` of the layout (another block's of the same shape) once for all of it, and again only where
    the header read says otherwise. `check_head` authenticates the header and table (a seal); every chunk read is
    checked against the table. CorruptBlockError or BlockMismatchError when what was read does not verify."""
    header_range = (base, base + HEADER_BYTES)
    if guess is not None:
        kept = guess.kept(reach)
        header, *rest = read([header_range, *_rest_ranges(guess, kept, base)])
    else:
        header, rest = read([header_range])[0], []
    if len(header) < _OLD_HEADER.size or version_of(header) != VERSION or len(header) < HEADER_BYTES:
        return None
    layout = _layout(header, expect_key, secure)
    if guess is None or not layout.same_shape(guess):
        kept = layout.kept(reach)
        rest = read(_rest_ranges(layout, kept, base))
    image = bytearray(layout.total_bytes)
    for (start, stop), piece in zip(_rest_ranges(layout, kept, 0), rest):
        if len(piece) != stop - start:
            raise CorruptBlockError(f"read {len(piece)} bytes of a {stop - start}-byte range: the value is shorter")
        image[start:stop] = piece
    image[:HEADER_BYTES] = header
    if check_head is not None and not check_head(bytes(image[:layout.head_bytes])):
        raise CorruptBlockError("the seal does not cover this header and table")
    layout.check(image, kept)
    return layout.block(image, kept)


def layout_of(data: bytes | bytearray | memoryview) -> Layout | None:
    """The layout a blob's (version-3) header states, unchecked against the rest; None for another version."""
    if len(data) < HEADER_BYTES or version_of(data) != VERSION:
        return None
    return Layout.parse(data)


def _rest_ranges(layout: Layout, kept: Sequence[int], base: int) -> Ranges:
    """What a part read fetches after the header: table and position ids, then the KV ranges, offset by `base`."""
    ranges = [(HEADER_BYTES, layout.head_bytes + layout.positions_bytes), *layout.ranges(kept)]
    return [(base + start, base + stop) for start, stop in ranges]


def _layout(data: bytes | bytearray | memoryview, expect_key: str | None, secure: bool) -> Layout:
    layout = Layout.parse(data)
    if expect_key is not None and layout.key != expect_key:
        raise BlockMismatchError(f"blob belongs to key {layout.key[:12]}..., not {expect_key[:12]}...")
    if secure and layout.digest_code != SHA256:
        raise CorruptBlockError("a signed store's blob must carry SHA-256 chunk digests")
    return layout


def _loads_old(data: bytes | bytearray | memoryview, expect_key: str | None) -> KVBlock:
    """A version-1 or -2 blob: one checksum over the payload."""
    _, version, code, _, key, layers, heads, tokens, dim, length, digest = _OLD_HEADER.unpack_from(data)
    if code not in _DTYPES:
        raise CorruptBlockError(f"unknown dtype code {code}")
    payload = memoryview(data)[_OLD_HEADER.size:]
    if len(payload) != length:
        raise CorruptBlockError(f"payload is {len(payload)} bytes, header says {length}")
    if _OLD_CHECKSUMS[version](payload) != digest:
        raise CorruptBlockError("checksum mismatch")
    stored_key = key.rstrip(b"\0").decode("ascii")
    if expect_key is not None and stored_key != expect_key:
        raise BlockMismatchError(f"blob belongs to key {stored_key[:12]}..., not {expect_key[:12]}...")
    dtype, shape = _DTYPES[code], (layers, heads, tokens, dim)
    n_pos, n_kv = tokens * 8, math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if n_pos + 2 * n_kv != length:
        raise CorruptBlockError("shape does not match payload length")
    buffer = bytearray(payload)  # one copy, writable, so tensors can own it
    return KVBlock(_tensor(buffer, dtype, shape, n_pos), _tensor(buffer, dtype, shape, n_pos + n_kv),
                   _tensor(buffer, torch.int64, (tokens,), 0))


def _raw(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.dtype == torch.bfloat16:  # numpy has no bfloat16: move the raw 16-bit words
        flat = flat.view(torch.int16)
    return flat.numpy().tobytes()


def _tensor(buffer: bytearray, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    if (count := math.prod(shape)) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)

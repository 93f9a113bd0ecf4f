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
from collections.abc import Callable, Sequence

import torch
import xxhash

from promptcache.cache_store.block import KVBlock
from promptcache.cache_store.block_layout import (
    DTYPE_CODES,
    DTYPES,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    SHA256,
    VERSION,
    XXH3,
    Layout,
    Ranges,
    buffer_tensor,
)
from promptcache.cache_store.errors import BlockMismatchError, CorruptBlockError
from promptcache.cache_store.layer_reach import LayerReach

CHUNK_TOKENS = 64
_OLD_CHECKSUMS = {  # versions 1 and 2: one digest of the payload, as stored in the 32-byte field
    1: lambda payload: hashlib.blake2b(payload, digest_size=32).digest(),
    2: lambda payload: xxhash.xxh3_128(payload).digest().ljust(32, b"\0"),
}
_OLD_HEADER = struct.Struct("<4sHBB64s4IQ32s")
Reader = Callable[[Ranges], list[bytes]]  # the bytes of each (start, stop) range of a stored value


def dumps(block: KVBlock, key: str = "", *, secure: bool = False) -> bytes:
    """Serialize `block` (stored under `key`) in version 3; `secure`: SHA-256 chunk digests (a signed store)."""
    if block.dtype not in DTYPE_CODES:
        raise BlockMismatchError(f"cannot serialize dtype {block.dtype}; supported: {list(DTYPE_CODES)}")
    if block.present is not None:
        raise BlockMismatchError("a block read in part is never stored: it lacks KV other requests read")
    payload = b"".join(map(_raw, (block.position_ids.to(torch.int64), block.keys, block.values)))
    layout = Layout(key, block.dtype, tuple(block.keys.shape), CHUNK_TOKENS,  # type: ignore[arg-type]  # 4-D
                    SHA256 if secure else XXH3, len(payload), b"")
    view, shift = memoryview(payload), layout.head_bytes  # spans count from the blob's start, the head's after it

    def span(tensor: int, layer: int, head: int, chunk: int) -> memoryview:
        start, stop = layout.span(tensor, layer, head, chunk * CHUNK_TOKENS,
                                   min((chunk + 1) * CHUNK_TOKENS, layout.shape[2]))
        return view[start - shift: stop - shift]

    heads = range(layout.shape[1])
    digests = [layout.digest([span(t, layer, h, c) for h in heads]) for t, layer, c in layout.chunks()]
    table = b"".join(digests) + layout.digest([view[:layout.positions_bytes]])
    header = HEADER.pack(MAGIC, VERSION, DTYPE_CODES[block.dtype], layout.digest_code,
                         key.encode("ascii").ljust(64, b"\0"), *block.keys.shape, CHUNK_TOKENS, len(payload),
                         layout.digest([memoryview(table)]).ljust(32, b"\0"))
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
    if code not in DTYPES:
        raise CorruptBlockError(f"unknown dtype code {code}")
    payload = memoryview(data)[_OLD_HEADER.size:]
    if len(payload) != length:
        raise CorruptBlockError(f"payload is {len(payload)} bytes, header says {length}")
    if _OLD_CHECKSUMS[version](payload) != digest:
        raise CorruptBlockError("checksum mismatch")
    stored_key = key.rstrip(b"\0").decode("ascii")
    if expect_key is not None and stored_key != expect_key:
        raise BlockMismatchError(f"blob belongs to key {stored_key[:12]}..., not {expect_key[:12]}...")
    dtype, shape = DTYPES[code], (layers, heads, tokens, dim)
    n_pos, n_kv = tokens * 8, math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if n_pos + 2 * n_kv != length:
        raise CorruptBlockError("shape does not match payload length")
    buffer = bytearray(payload)  # one copy, writable, so tensors can own it
    return KVBlock(buffer_tensor(buffer, dtype, shape, n_pos), buffer_tensor(buffer, dtype, shape, n_pos + n_kv),
                   buffer_tensor(buffer, torch.int64, (tokens,), 0))


def _raw(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.dtype == torch.bfloat16:  # numpy has no bfloat16: move the raw 16-bit words
        flat = flat.view(torch.int16)
    return flat.numpy().tobytes()

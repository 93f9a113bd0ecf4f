"""A compact, versioned binary format for KV blocks, with a checksum and the key it belongs to.

Layout (little endian): magic "PCKV" | u16 version | u8 dtype code | u8 reserved | 64-byte key (ascii hex,
zero-padded) | 4 x u32 shape (layers, kv_heads, tokens, head_dim) | u64 payload length | 32-byte checksum
| payload = position ids (int64) + keys + values. The checksum detects damage (authenticity is signing.py's
job): version 2 writes XXH3-128 (~10 GB/s; version 1's blake2b-256, still read, was most of a shared read).
"""

from __future__ import annotations

import hashlib
import math
import struct

import torch
import xxhash

from promptcache.cache_store.block import KVBlock
from promptcache.cache_store.errors import BlockMismatchError, CorruptBlockError

MAGIC = b"PCKV"
VERSION = 2
_CHECKSUMS = {  # version -> digest of the payload, as stored in the 32-byte field
    1: lambda payload: hashlib.blake2b(payload, digest_size=32).digest(),
    2: lambda payload: xxhash.xxh3_128(payload).digest().ljust(32, b"\0"),
}
_HEADER = struct.Struct("<4sHBB64s4IQ32s")
HEADER_BYTES = _HEADER.size
_DTYPES = {1: torch.float32, 2: torch.float16, 3: torch.bfloat16}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}


def dumps(block: KVBlock, key: str = "") -> bytes:
    """Serialize `block` (stored under `key`)."""
    if block.dtype not in _CODES:
        raise BlockMismatchError(f"cannot serialize dtype {block.dtype}; supported: {list(_CODES)}")
    payload = b"".join(map(_raw, (block.position_ids.to(torch.int64), block.keys, block.values)))
    return _HEADER.pack(MAGIC, VERSION, _CODES[block.dtype], 0, key.encode("ascii").ljust(64, b"\0"),
                        *block.keys.shape, len(payload), _CHECKSUMS[VERSION](payload)) + payload


def loads(data: bytes | bytearray | memoryview, *, expect_key: str | None = None) -> KVBlock:
    """Parse and verify a blob; CorruptBlockError if damaged, BlockMismatchError if it is another key's."""
    if len(data) < _HEADER.size:
        raise CorruptBlockError(f"blob of {len(data)} bytes is shorter than the {_HEADER.size}-byte header")
    magic, version, code, _, key, layers, heads, tokens, dim, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptBlockError(f"bad magic {magic!r}")
    if version not in _CHECKSUMS:
        raise CorruptBlockError(f"unsupported format version {version} (this build reads {sorted(_CHECKSUMS)})")
    if code not in _DTYPES:
        raise CorruptBlockError(f"unknown dtype code {code}")
    payload = memoryview(data)[_HEADER.size:]
    if len(payload) != length:
        raise CorruptBlockError(f"payload is {len(payload)} bytes, header says {length}")
    if _CHECKSUMS[version](payload) != digest:
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
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)

"""KVBlock: the cached attention states of one token run, all layers; the keys naming them; their binary format.
A key is SHA-256 over everything that determines a link's KV (a module segment after its encoding context, or a
prefix block after its parent link, which goes in as `context_digest`: a key covers the whole chain before it).
A serialized block (little endian): magic "PCKV" | u16 version | u8 dtype code | u8 reserved | 64-byte key (ascii
hex, zero-padded) | 4 x u32 shape (layers, kv_heads, tokens, head_dim) | u64 payload length | 32-byte checksum |
payload = position ids (int64) + keys + values. The checksum detects damage (authenticity is signing.py's job):
version 2 writes XXH3-128 (~10 GB/s; version 1's blake2b-256, still read, was most of a shared read)."""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from promptcache.cache_store.errors import BlockMismatchError, CorruptBlockError


@dataclass(frozen=True, slots=True, eq=False)
class KVBlock:
    """Post-RoPE keys and values of `num_tokens` tokens for every layer, and their position ids."""

    keys: torch.Tensor          # [num_layers, num_kv_heads, num_tokens, head_dim]
    values: torch.Tensor        # [num_layers, num_kv_heads, num_tokens, head_dim]
    position_ids: torch.Tensor  # [num_tokens] int64

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

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return (self.keys.numel() * self.keys.element_size() * 2
                + self.position_ids.numel() * self.position_ids.element_size())

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
        if not pin_memory:
            return KVBlock(self.keys.to(device), self.values.to(device), self.position_ids.to("cpu"))
        keys, values = (torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                        for t in (self.keys, self.values))
        if self.keys.is_cuda:  # the host reads these (serialization, later copies): wait for the copies
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event() unannotated
            done.record(torch.cuda.current_stream(self.keys.device))
            done.synchronize()
        return KVBlock(keys, values, self.position_ids.to("cpu"))


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
    if (count := math.prod(shape)) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)

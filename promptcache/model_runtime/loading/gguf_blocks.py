"""GGUF's 4-bit block types as Int4Blocks (per 32 inputs `w = scale * q + minimum`, q in 0..15), read bit for bit:
Q4_0 (`d * (q - 8)`: scale d, minimum -8 d), Q4_1 (`d * q + m`) and Q4_K (super-blocks of 256 with eight 6-bit scales
and mins, `d * sc * q - dmin * m`: scale d * sc, minimum -dmin * m); its 8-bit ones as Int8Blocks (`scale * q` per 32
inputs): Q8_0 (`d * q`) and Q5_0 (`d * (q - 16)`, q in 0..31), and Q6_K (super-blocks of 256 with sixteen int8 scales,
`d * sc * (q - 32)`, q in 0..63: Int8Blocks of 16-input groups, scale d * sc). In fp32 each product and the one sum
round as gguf's own dequantize rounds them, so the weights are equal bit for bit
(tests/model_runtime/test_gguf_blocks.py)."""

from __future__ import annotations

import numpy as np
import torch

from promptcache.model_runtime.loading.quantized_linear import GROUP_SIZE, Int4Blocks
from promptcache.model_runtime.loading.stored_linear import INT8_SUB_GROUP, Int8Blocks

Q4_0_BLOCK_BYTES = 2 + GROUP_SIZE // 2  # fp16 d, 32 nibbles
Q4_1_BLOCK_BYTES = 4 + GROUP_SIZE // 2  # fp16 d, fp16 m, 32 nibbles
Q8_0_BLOCK_BYTES = 2 + GROUP_SIZE  # fp16 d, 32 int8
Q5_0_BLOCK_BYTES = 2 + 4 + GROUP_SIZE // 2  # fp16 d, 32 fifth bits, 32 nibbles
SUPER_BLOCK = 256  # QK_K: weights of one Q4_K block
Q4_K_BLOCK_BYTES = 4 + 12 + SUPER_BLOCK // 2  # fp16 d, fp16 dmin, 8 x (6-bit scale, 6-bit min) in 12 bytes, nibbles
_SUB_BLOCKS = SUPER_BLOCK // GROUP_SIZE  # 8
Q6_K_BLOCK_BYTES = SUPER_BLOCK // 2 + SUPER_BLOCK // 4 + SUPER_BLOCK // INT8_SUB_GROUP + 2  # ql, qh, scales, d


def q4_0_blocks(raw: np.ndarray) -> Int4Blocks:
    """Q4_0 bytes [out, in / 32 * 18] -> Int4Blocks (a block: fp16 d, nibbles of values 0..15 | 16..31)."""
    data = _bytes(raw, Q4_0_BLOCK_BYTES)  # [out, in / G, 18]
    d = _fp16(data[..., 0:2])  # [out, in / G]
    return Int4Blocks(_low_then_high(data[..., 2:]), d, -8 * d)


def q4_1_blocks(raw: np.ndarray) -> Int4Blocks:
    """Q4_1 bytes [out, in / 32 * 20] -> Int4Blocks (a block: fp16 d, fp16 m, nibbles of values 0..15 | 16..31)."""
    data = _bytes(raw, Q4_1_BLOCK_BYTES)  # [out, in / G, 20]
    return Int4Blocks(_low_then_high(data[..., 4:]), _fp16(data[..., 0:2]), _fp16(data[..., 2:4]))


def q4_k_blocks(raw: np.ndarray) -> Int4Blocks:
    """Q4_K bytes [out, in / 256 * 144] -> Int4Blocks, one group per sub-block (ggml's block_q4_K)."""
    data = _bytes(raw, Q4_K_BLOCK_BYTES)  # [out, in / 256, 144]
    out_features, num_super = data.shape[:2]
    d, dmin = _fp16(data[..., 0:2]), _fp16(data[..., 2:4])  # [out, in / 256]
    # ggml's get_scale_min_k4: bytes 0-3 hold sub-blocks 0-3's scales in their low 6 bits, 4-7 their mins; sub-blocks
    # 4-7 take their low 4 bits from bytes 8-11 (scale: low nibble, min: high) and their top 2 from bytes 0-3 / 4-7.
    packed = data[..., 4:16].view(out_features, num_super, 3, 4)  # [out, in / 256, 3, 4]
    low_sc, low_m, high = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = torch.cat([low_sc & 0x3F, (high & 0x0F) | ((low_sc >> 2) & 0x30)], dim=-1)  # [out, in / 256, 8]
    m = torch.cat([low_m & 0x3F, (high >> 4) | ((low_m >> 2) & 0x30)], dim=-1)
    scales = (d[..., None] * sc.float()).reshape(out_features, -1)  # [out, in / G]
    minimums = -(dmin[..., None] * m.float()).reshape(out_features, -1)
    # 4 chunks of 32 bytes: chunk j's low nibbles are sub-block 2j, its high nibbles sub-block 2j + 1
    nibbles = data[..., 16:].reshape(out_features, num_super, 4, 1, GROUP_SIZE)  # [out, in / 256, 4, 1, 32]
    values = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=3)  # [out, in / 256, 4, 2, 32]
    return Int4Blocks(values.reshape(out_features, -1), scales, minimums)


def q8_0_blocks(raw: np.ndarray) -> Int8Blocks:
    """Q8_0 bytes [out, in / 32 * 34] -> Int8Blocks (a block: fp16 d, 32 int8)."""
    data = _bytes(raw, Q8_0_BLOCK_BYTES)  # [out, in / G, 34]
    return Int8Blocks(data[..., 2:].contiguous().view(torch.int8).reshape(data.shape[0], -1), _fp16(data[..., 0:2]))


def q5_0_blocks(raw: np.ndarray) -> Int8Blocks:
    """Q5_0 bytes [out, in / 32 * 22] -> Int8Blocks of q - 16 (ggml's block_q5_0: fp16 d, a little-endian uint32
    whose bit j is value j's fifth bit, nibbles of values 0..15 | 16..31)."""
    data = _bytes(raw, Q5_0_BLOCK_BYTES)  # [out, in / G, 22]
    high_bits = data[..., 2:6].to(torch.int64)  # [out, in / G, 4] bytes of the uint32, low byte first
    bit = torch.arange(GROUP_SIZE)
    fifth = (high_bits[..., bit // 8] >> (bit % 8)) & 1  # [out, in / G, 32]
    values = _low_then_high(data[..., 6:]).view(*fifth.shape).to(torch.int64) | (fifth << 4)  # 0..31
    return Int8Blocks((values - 16).to(torch.int8).reshape(data.shape[0], -1), _fp16(data[..., 0:2]))


def q6_k_blocks(raw: np.ndarray) -> Int8Blocks:
    """Q6_K bytes [out, in / 256 * 210] -> Int8Blocks of q - 32 in 16-input groups (ggml's block_q6_K: 128 bytes of low
    nibbles, 64 of high bit pairs, 16 int8 scales, fp16 d). Each half of 128 weights: value 32 i + l (i = 0..3,
    l = 0..31) takes its low nibble from byte l (i even) or l + 32 (i odd) of the half's 64, the low nibble for i < 2,
    the high for i >= 2, and its two high bits from bits 2 i, 2 i + 1 of the half's qh byte l."""
    data = _bytes(raw, Q6_K_BLOCK_BYTES)  # [out, in / 256, 210]
    out_features, num_super = data.shape[:2]
    low = data[..., :128].reshape(out_features, num_super, 2, 2, 32)  # [.., half, l + 32 j, l]
    high = data[..., 128:192].reshape(out_features, num_super, 2, 1, 32).to(torch.int16)  # [.., half, 1, l]
    nibbles = torch.stack([low & 0x0F, low >> 4], dim=3).reshape(out_features, num_super, 2, 4, 32)  # i = 2 s + j
    shifts = (2 * torch.arange(4)).view(4, 1)  # i = 0..3 -> bits 2 i
    values = nibbles.to(torch.int16) | (((high >> shifts) & 3) << 4)  # [out, in / 256, 2, 4, 32], 0..63
    scales = data[..., 192:208].contiguous().view(torch.int8).float()  # [out, in / 256, 16]
    d = _fp16(data[..., 208:210])  # [out, in / 256]
    return Int8Blocks((values - 32).to(torch.int8).reshape(out_features, -1),
                      (d[..., None] * scales).reshape(out_features, -1))


def _bytes(raw: np.ndarray, block_bytes: int) -> torch.Tensor:
    """A tensor's stored bytes [out, row bytes] as [out, blocks, block_bytes] uint8 (a copy: the file is mapped)."""
    data = torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8).copy())
    return data.view(data.shape[0], -1, block_bytes)


def _fp16(pair: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 bytes [..., 2] -> float32 [...]."""
    return pair.contiguous().view(torch.float16).squeeze(-1).float()


def _low_then_high(nibbles: torch.Tensor) -> torch.Tensor:
    """Q4_0/Q4_1 nibbles [out, blocks, 16] -> values [out, in]: a block's low nibbles are its values 0..15."""
    return torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(nibbles.shape[0], -1)

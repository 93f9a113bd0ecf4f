"""One request's KV: a single preallocated buffer for all layers.

Cached module states are copied in once (one allocation per request, not one per layer per step);
new and generated tokens are written in place after them by the packed forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from promptcache.cache_store import KVBlock


class KVBuffer:
    """`keys`/`values`: [num_layers, 1, num_kv_heads, capacity, head_dim]; `length` tokens are filled."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, 1, num_kv_heads, capacity, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)    # [L, 1, H_kv, capacity, D]
        self.values = torch.empty(shape, dtype=dtype, device=device)  # [L, 1, H_kv, capacity, D]
        self.length = 0
        self.capacity = capacity
        self.num_layers = num_layers

    @classmethod
    def from_blocks(cls, blocks: Sequence[KVBlock], *, extra: int, num_layers: int, num_kv_heads: int,
                    head_dim: int, dtype: torch.dtype, device: torch.device | str) -> KVBuffer:
        """Copy `blocks` (in order) into a new buffer with room for `extra` more tokens."""
        cached = sum(b.num_tokens for b in blocks)
        buffer = cls(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     capacity=cached + extra, dtype=dtype, device=device)
        offset = 0
        for block in blocks:
            n = block.num_tokens
            # block.keys: [L, H_kv, n, D] -> buffer slice [L, 1, H_kv, n, D]
            buffer.keys[:, 0, :, offset: offset + n].copy_(block.keys)
            buffer.values[:, 0, :, offset: offset + n].copy_(block.values)
            offset += n
        buffer.length = cached
        return buffer

    def truncate(self, length: int) -> None:
        """Forget every state from `length` on (used to recompute the last cached token)."""
        assert 0 <= length <= self.length
        self.length = length

    def block(self, start: int, end: int, position_ids: torch.Tensor) -> KVBlock:
        """A standalone copy of states [start, end) as a KVBlock (for storing encoded segments)."""
        return KVBlock(keys=self.keys[:, 0, :, start:end].clone(), values=self.values[:, 0, :, start:end].clone(),
                       position_ids=position_ids)

    def clone(self) -> KVBuffer:
        """A copy of the filled part with the same capacity (one sample of several)."""
        copy = KVBuffer(num_layers=self.num_layers, num_kv_heads=self.keys.shape[2], head_dim=self.keys.shape[-1],
                        capacity=self.capacity, dtype=self.keys.dtype, device=self.keys.device)
        copy.keys[:, :, :, : self.length].copy_(self.keys[:, :, :, : self.length])
        copy.values[:, :, :, : self.length].copy_(self.values[:, :, :, : self.length])
        copy.length = self.length
        return copy

"""One request's KV: a single preallocated buffer for all layers, exposed to HF models as a Cache.

Cached module states are copied into the buffer once (one allocation per request, not one per layer
per step); new and generated tokens are written in place after them. Each layer sees views.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from promptcache.cache_store import KVBlock


class _BufferLayer(CacheLayerMixin):
    """One layer's view of the request buffer; `update` appends in place and returns views."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: KVBuffer, layer_idx: int) -> None:
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.owner.append(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.capacity

    @property
    def keys(self) -> torch.Tensor:  # type: ignore[override]
        return self.owner.keys[self.layer_idx, :, :, : self.owner.length]

    @keys.setter
    def keys(self, value) -> None:  # CacheLayerMixin.__init__ assigns None
        pass

    @property
    def values(self) -> torch.Tensor:  # type: ignore[override]
        return self.owner.values[self.layer_idx, :, :, : self.owner.length]

    @values.setter
    def values(self, value) -> None:
        pass


class KVBuffer(Cache):
    """Preallocated KV for one sequence: `[num_layers, 1, num_kv_heads, capacity, head_dim]`.

    `length` counts the tokens whose states are stored. During a forward pass every layer appends the
    same tokens at [length, length + n); the last layer's append advances `length`.
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, 1, num_kv_heads, capacity, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)    # [L, 1, H_kv, capacity, D]
        self.values = torch.empty(shape, dtype=dtype, device=device)  # [L, 1, H_kv, capacity, D]
        self.length = 0
        self.capacity = capacity
        self.num_layers = num_layers
        super().__init__(layers=[_BufferLayer(self, i) for i in range(num_layers)])

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

    def append(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        # keys: [1, H_kv, n, D], written at [length, length + n) for this layer
        n = keys.shape[-2]
        end = self.length + n
        if end > self.capacity:
            raise RuntimeError(f"KV buffer overflow: {end} > capacity {self.capacity}")
        self.keys[layer_idx, :, :, self.length: end].copy_(keys)
        self.values[layer_idx, :, :, self.length: end].copy_(values)
        out = self.keys[layer_idx, :, :, :end], self.values[layer_idx, :, :, :end]
        if layer_idx == self.num_layers - 1:
            self.length = end
        return out

    def truncate(self, length: int) -> None:
        """Forget every state from `length` on (used to recompute the last cached token)."""
        assert 0 <= length <= self.length
        self.length = length

    def block(self, start: int, end: int, position_ids: torch.Tensor) -> KVBlock:
        """A standalone copy of states [start, end) as a KVBlock (for storing encoded segments)."""
        return KVBlock(keys=self.keys[:, 0, :, start:end].clone(), values=self.values[:, 0, :, start:end].clone(),
                       position_ids=position_ids)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

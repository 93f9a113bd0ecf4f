"""KVBlock: the cached attention states of one token run, all layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from promptcache.cache_store.errors import BlockMismatchError


@dataclass(frozen=True, slots=True, eq=False)
class KVBlock:
    """Post-RoPE attention states of one cached token run, all layers.

    Blocks are shared, not copied, by the tiers that hold them: treat the tensors as read-only.
    `position_ids` is metadata and always lives on the CPU; `keys`/`values` live on `device`.
    Raises BlockMismatchError when the tensors do not form a block (they may come from a blob).
    """

    keys: torch.Tensor          # [num_layers, num_kv_heads, num_tokens, head_dim]
    values: torch.Tensor        # [num_layers, num_kv_heads, num_tokens, head_dim]
    position_ids: torch.Tensor  # [num_tokens] int64

    def __post_init__(self) -> None:
        keys, values, positions = self.keys, self.values, self.position_ids
        if keys.dim() != 4 or keys.shape != values.shape:
            raise BlockMismatchError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must have one "
                                     "4-D shape [num_layers, num_kv_heads, num_tokens, head_dim]")
        if keys.dtype != values.dtype or keys.device != values.device:
            raise BlockMismatchError(f"keys are {keys.dtype} on {keys.device} but values are {values.dtype} "
                                     f"on {values.device}")
        if positions.dim() != 1 or positions.dtype != torch.int64 or positions.numel() != keys.shape[2]:
            raise BlockMismatchError(f"position_ids must be int64 [{keys.shape[2]}], got {positions.dtype} "
                                     f"{tuple(positions.shape)}")

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held: keys + values + position ids (what tier budgets count)."""
        kv_bytes = self.keys.numel() * self.keys.element_size()
        return 2 * kv_bytes + self.position_ids.numel() * self.position_ids.element_size()

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def to(self, device: torch.device | str) -> KVBlock:
        """This block with keys/values on `device`; `self` if they are already there."""
        device = torch.device(device)
        if _same_device(self.keys.device, device):
            return self
        return KVBlock(self.keys.to(device), self.values.to(device), self.position_ids.cpu())

    def pin_memory(self) -> KVBlock:
        """A page-locked CPU copy (fast, async copies to a GPU); `self` without CUDA or if already pinned."""
        if not torch.cuda.is_available() or self.keys.is_pinned():
            return self
        host = self.to("cpu")
        return KVBlock(host.keys.pin_memory(), host.values.pin_memory(), host.position_ids)


def _same_device(have: torch.device, want: torch.device) -> bool:
    # "cuda" (no index) means the current device: compare the type only then.
    return have.type == want.type and (want.index is None or have.index == want.index)

"""KVBlock: the cached attention states of one token run, all layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from promptcache.cache_store.errors import BlockMismatchError


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

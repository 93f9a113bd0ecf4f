"""A step's attention in deterministic serving: each sequence attends its own logical key sequence (its shared KV in
its order, then its own KV) through the kernel's `AttentionPlan`, built once per forward pass; nothing is grouped
across sequences (no shared-segment calls), so a sequence's result is the same alone or in any batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from promptcache.model_runtime.deterministic import kernels

# A sequence's attention inputs: (shared KV in order: (keys, values [L, H_kv, n, D], first row that sees it)),
# own keys and values [L, H_kv, capacity, D], own keys after this step's writes, query rows this step.
SeqKeys = tuple[Sequence[tuple[torch.Tensor, torch.Tensor, int]], torch.Tensor, torch.Tensor, int, int]


def attention_plan(seqs: Sequence[SeqKeys]) -> Any:
    """The kernel's AttentionPlan for a step's sequences in row order; `attend(q [T, H, D], layer, scale)` per layer."""
    module = kernels.prepare()
    assert module is not None, "deterministic serving runs only where the kernels loaded"
    return module.AttentionPlan(
        [[k for k, _, _ in shared] for shared, *_ in seqs], [[v for _, v, _ in shared] for shared, *_ in seqs],
        [[first for _, _, first in shared] for shared, *_ in seqs], [s[1] for s in seqs], [s[2] for s in seqs],
        [s[3] for s in seqs], [s[4] for s in seqs])


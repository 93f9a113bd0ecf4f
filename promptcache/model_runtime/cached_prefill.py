"""Cached prefill: assemble a plan's cached KV into one buffer, then compute only its new tokens."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from promptcache.model_runtime.forward import logits_of, run_tokens
from promptcache.model_runtime.kv_buffer import KVBuffer
from promptcache.model_runtime.module_encoder import ModuleEncoder, check_positions
from promptcache.model_runtime.results import ModuleUse, slowest_tier
from promptcache.pml import PromptPlan


@dataclass(slots=True, eq=False)
class PrefilledPrompt:
    """A prompt after prefill: its KV buffer, next-token logits and the cache report."""

    buffer: KVBuffer
    logits: torch.Tensor  # [vocab] float32
    next_position: int
    modules: tuple[ModuleUse, ...]
    num_computed_tokens: int
    encode_ms: float
    assembly_ms: float
    prefill_ms: float


def prefill(encoder: ModuleEncoder, plan: PromptPlan, *, cache_salt: str | None = None,
            extra_capacity: int = 0) -> PrefilledPrompt:
    """Gather the plan's cached segments (encoding any missing), then run its new tokens.

    The buffer has room for `extra_capacity` generated tokens. When the plan has no new token, the
    last cached token is recomputed so that the next-token distribution exists.
    """
    loaded = encoder.loaded
    started = time.perf_counter()
    before = encoder.num_encoded_segments
    fetched = [encoder.fetch(plan.schema, c.segment.segment_id, c.context_ids, cache_salt) for c in plan.cached]
    encoded_s = time.perf_counter() - started if encoder.num_encoded_segments != before else 0.0
    device = loaded.model.device
    buffer = KVBuffer.from_blocks(
        [f.block.to(device) for f in fetched], extra=plan.num_new_tokens + 1 + extra_capacity,
        num_layers=loaded.num_layers, num_kv_heads=loaded.num_kv_heads, head_dim=loaded.head_dim,
        dtype=loaded.model.dtype, device=device)
    assembled = time.perf_counter()

    token_ids, position_ids = plan.new_token_ids(), plan.new_position_ids()
    if not token_ids:
        # Buffer order is position order, so the last state is the highest-positioned cached token.
        last = plan.cached[-1].segment
        buffer.truncate(buffer.length - 1)
        token_ids, position_ids = [last.token_ids[-1]], [last.end - 1]
    check_positions(position_ids, loaded.max_positions)
    with torch.inference_mode():
        hidden = run_tokens(loaded.model, buffer, token_ids, position_ids)
        logits = logits_of(loaded.model, hidden)
    done = time.perf_counter()

    tiers: dict[str, list[str]] = defaultdict(list)
    sizes: dict[str, int] = defaultdict(int)
    for cached, got in zip(plan.cached, fetched):
        tiers[cached.segment.owner].append(got.tier)
        sizes[cached.segment.owner] += len(cached.segment.token_ids)
    modules = tuple(ModuleUse(path, sizes[path], slowest_tier(tiers[path]) if tiers[path] else "computed")
                    for path in plan.module_paths)
    return PrefilledPrompt(
        buffer=buffer, logits=logits, next_position=max(plan.position_ids()) + 1, modules=modules,
        num_computed_tokens=len(token_ids), encode_ms=encoded_s * 1e3,
        assembly_ms=(assembled - started) * 1e3, prefill_ms=(done - assembled) * 1e3)

"""Decode baselines replayed from CUDA graphs, so a graphed engine step is compared with graphed baselines: the same
StaticForward (engine/static_step.py: the model's fused layers, lm_head and argmax) with attention swapped for
- sdpa: each sequence's KV in a buffer of its own ([L, B * L_max, H_kv, D]), attended by flash attention's varlen
  kernel reading each length from the device (`seqused_k`), natively GQA: the per-sequence SDPA step, graphed;
- noattention: attention output := query, no KV write (the ceiling).
Inputs (ids, positions, write slots, lengths) come from one pinned host buffer by one copy a step, as the engine's
do. On a CPU (smoke) the same forward runs eagerly, attention by SDPA under a length mask."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from promptcache.model_runtime.engine.static_step import StaticForward, static_forward_supported

MODES = ("baseline_sdpa", "noattention")


def run_graphed(mode: str, model, batch: int, shared: int, own: int, steps: int) -> dict | None:
    """Time `steps - 2` decode steps of `mode` (after a warm-up step and the capture), or None where the model has no
    StaticForward (unfused layers)."""
    if not static_forward_supported(model):
        return None
    device, dtype = model.device, model.dtype
    forward = StaticForward(model)
    layers, kv_heads, dim = len(forward.layers), forward.num_kv_heads, forward.head_dim
    max_len = shared + own + steps
    # [L, B * L_max, H_kv, D]: sequence b's keys are rows b * L_max .. b * L_max + length_b - 1
    keys = torch.full((layers, batch * max_len, kv_heads, dim), 0.01, dtype=dtype, device=device)
    values = torch.full_like(keys, 0.01)
    host = torch.zeros(4 * batch, dtype=torch.int64, pin_memory=device.type == "cuda")  # ids|positions|slots|lengths
    flat = torch.zeros(4 * batch, dtype=torch.int64, device=device)
    ids, positions, slots = flat[:batch], flat[batch: 2 * batch], flat[2 * batch: 3 * batch]
    lengths = flat[3 * batch:].view(torch.int32)[:batch]                      # [B] int32 (half the field)
    last_rows = torch.arange(batch, device=device)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
    cu_k = cu_q * max_len

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int) -> torch.Tensor:
        if mode == "noattention":
            return query
        keys[layer].index_copy_(0, slots, key)
        values[layer].index_copy_(0, slots, value)
        if device.type == "cuda":
            return torch.ops.aten._flash_attention_forward(
                query, keys[layer], values[layer], cu_q, cu_k, 1, max_len, 0.0, False, False,
                scale=forward.scale, seqused_k=lengths)[0]                      # [B, H, D]
        k = keys[layer].view(batch, max_len, kv_heads, dim).transpose(1, 2)    # [B, H_kv, L_max, D]
        v = values[layer].view(batch, max_len, kv_heads, dim).transpose(1, 2)
        mask = torch.arange(max_len, device=device)[None, :] < lengths[:, None].long()  # [B, L_max]
        out = F.scaled_dot_product_attention(query[:, :, None], k, v, attn_mask=mask[:, None, None], enable_gqa=True,
                                             scale=forward.scale)                # [B, H, 1, D]
        return out[:, :, 0]

    def fill(t: int) -> None:
        length = shared + own + t  # keys before this step's
        host[:batch] = torch.arange(batch) % 1000
        host[batch: 2 * batch] = length
        host[2 * batch: 3 * batch] = torch.arange(batch) * max_len + length
        host[3 * batch:].view(torch.int32)[:batch] = length + 1
        flat.copy_(host, non_blocking=True)

    def eager():
        return forward.run(ids, positions, last_rows, attention)

    with torch.inference_mode():
        fill(0)
        eager()  # warm-up
        graph = _capture(eager) if device.type == "cuda" else None
        _synchronize(device)
        started = time.perf_counter()
        for t in range(2, steps):
            fill(t)
            graph.replay() if graph is not None else eager()
        _synchronize(device)  # once, as run_mode times the eager modes
        elapsed = time.perf_counter() - started
    return {"mode": f"{mode}_graph", "graph": graph is not None, "batch": batch, "shared_tokens": shared,
            "own_tokens": own, "dtype": str(dtype).removeprefix("torch."),
            "tokens_per_s": round(batch * (steps - 2) / elapsed, 2),
            "ms_per_step": round(elapsed / (steps - 2) * 1e3, 2)}


def _capture(work) -> torch.cuda.CUDAGraph:
    """`work` captured on a side stream (warmed up already)."""
    stream, current = torch.cuda.Stream(), torch.cuda.current_stream()
    stream.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            work()
        finally:
            graph.capture_end()
    current.wait_stream(stream)
    return graph


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

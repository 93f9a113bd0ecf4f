"""StaticForward: a uniform step's forward over static buffers (step_buffers.py), embedding -> the model's own fused
layers -> final norm -> lm_head -> greedy argmax, with no host sync and no host-built tensor, so a CUDA graph can
capture it (cuda_graphs.py) and the CPU can run it eagerly as the tests' oracle comparison."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from promptcache.model_runtime.attention.static_attention import StaticTables, attend
from promptcache.model_runtime.engine.step_buffers import StepBuffers
from promptcache.model_runtime.loading.fused_layers import fused_decoder_layers

# Rotary kinds whose tables depend on positions only (a length-dependent kind would read the length on the host).
_STATIC_ROPE = frozenset({"default", "linear", "llama3"})


# (query [R, H, D], key [R, H_kv, D], value [R, H_kv, D], layer) -> out [R, H, D]: writes the layer's KV, attends
LayerAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def pool_attention(tables: StaticTables, write_slots: torch.Tensor, scale: float) -> LayerAttention:
    """The engine's static attention: every row's KV into the pool at its write slot (pads: their trash slots), one
    `index_copy_` for keys and one for values, then one attention op over `tables`."""
    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int) -> torch.Tensor:
        tables.pool_keys[layer].index_copy_(1, write_slots, key.transpose(0, 1))    # [H_kv, slots, D] <- [H_kv, R, D]
        tables.pool_values[layer].index_copy_(1, write_slots, value.transpose(0, 1))
        return attend(query, layer, scale, tables)                                 # [R, H, D]
    return attention


class StepOutput(NamedTuple):
    """A static step's outputs, one row per sequence of the shape (pads included: slice the real ones)."""

    logits: torch.Tensor      # [B, vocab] float32
    greedy_ids: torch.Tensor  # [B] int64: argmax of each row


def static_forward_supported(model: Any) -> bool:
    """Whether `model` (a causal LM) can take static steps: every layer fused and its rotary table position-only."""
    base = model.base_model
    rotary = getattr(base, "rotary_emb", None)
    return (fused_decoder_layers(base) is not None and rotary is not None
            and getattr(rotary, "rope_type", "default") in _STATIC_ROPE)


def _rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """x [R, H] (or [R, heads, D]: per head) -> RMSNorm with `norm`'s weight, one op (statistics in fp32 inside; one
    rounding at the end where the HF module rounds before the weight: bf16 outputs may differ from the eager pass's in
    the last bit)."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)


def _linear_add(residual: torch.Tensor, x: torch.Tensor, linear: torch.nn.Module) -> torch.Tensor:
    """residual + linear(x): one addmm for a plain bias-free Linear (the residual added in the GEMM's epilogue)."""
    if type(linear) is torch.nn.Linear and linear.bias is None:
        return torch.addmm(residual, x, linear.weight.t())
    return residual + linear(x)


class StaticForward:
    """The forward of a uniform step. Reads everything a step changes from `StepBuffers` views and the pool; writes
    each row's new KV to its `write_slots` entry (pads: trash slots). Call `static_forward_supported` first."""

    def __init__(self, model: Any) -> None:
        base = model.base_model
        layers = fused_decoder_layers(base)
        assert layers is not None, "static_forward_supported(model) first"
        self.base, self.layers, self.lm_head = base, layers, model.get_output_embeddings()
        first = layers[0].self_attn
        self.num_heads, self.num_kv_heads = first.num_heads, first.num_key_value_heads
        self.head_dim, self.scale = first.head_dim, first.scaling
        half = self.head_dim // 2
        weight = layers[0].input_layernorm.weight
        # [D]: -1 on the first half, +1 on the second; made here, never inside a capture (it would bake a host address)
        self._half_sign = torch.cat([-torch.ones(half), torch.ones(self.head_dim - half)]).to(weight.device,
                                                                                              weight.dtype)

    def __call__(self, buffers: StepBuffers, tables: StaticTables) -> StepOutput:
        """The step over `buffers`: each row's KV written to the pool at its write slot, attention over `tables`."""
        views = buffers.views
        return self.run(views["input_ids"], views["positions"], views["last_rows"],
                        pool_attention(tables, views["write_slots"], self.scale))

    def run(self, ids: torch.Tensor, positions: torch.Tensor, last_rows: torch.Tensor,
            attention: LayerAttention) -> StepOutput:
        """ids, positions [R] -> the last rows' (`last_rows` [B]) logits and argmax; `attention` writes a layer's KV
        and attends (the benchmarks' baselines pass their own, in the same graph-capturable forward)."""
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        rows = ids.shape[0]
        hidden = self.base.embed_tokens(ids)                                  # [R, hidden]
        cos, sin = self.base.rotary_emb(hidden[None], position_ids=positions[None])  # [1, R, D] each
        # rotate_half(x) * sin == roll(x, D/2) * (sin with its first half negated): RoPE in 3 ops a layer.
        cos, sin = cos[0, :, None], (sin[0] * self._half_sign)[:, None]     # [R, 1, D]
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = attn.qkv_proj(_rms_norm(hidden, layer.input_layernorm))    # [R, (H + 2 H_kv) D]
            qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
            if attn.q_norm is not None:  # Qwen3: each head of q and k RMS-normalised before RoPE
                qk = torch.cat([_rms_norm(qk[:, :heads], attn.q_norm), _rms_norm(qk[:, heads:], attn.k_norm)], dim=1)
            qk = torch.addcmul(qk * cos, qk.roll(dim // 2, dims=-1), sin)      # [R, H + H_kv, D]
            value = qkv[:, (heads + kv_heads) * dim:].view(rows, kv_heads, dim)  # [R, H_kv, D]
            attended = attention(qk[:, :heads], qk[:, heads:], value, attn.layer_idx)  # [R, H, D]
            hidden = _linear_add(hidden, attended.reshape(rows, heads * dim), attn.o_proj)
            gate_up = mlp.gate_up_proj(_rms_norm(hidden, layer.post_attention_layernorm))  # [R, 2 I]
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = _linear_add(hidden, torch.nn.functional.silu(gate) * up, mlp.down_proj)
        last = self.base.norm(hidden.index_select(0, last_rows))              # [B, hidden]
        logits = self.lm_head(last).float()                                     # [B, vocab]
        return StepOutput(logits, logits.argmax(dim=-1))

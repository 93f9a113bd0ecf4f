"""Gemma 3 text models' fused modules on a CPU (`fuse_gemma`): in fp32 with the AVX2 library, in bf16 with the bf16
kernels. Its (1 + w) RMSNorms as one pass each (fp32: the AVX2 kernel; bf16: the bf16 kernels' in fp32, rounded
once to bf16 as HF's module rounds), q|k|v and gate|up as one projection each (one pass over a layer's
weights instead of three and two), q and k normalised per head and rotated in one pass, GELU-tanh times up as torch
ops. The decoder layers, the scaled embedding and the RoPE of each layer type (local 10K, global 1M) stay Hugging
Face's, which hand each attention block its layer type's cos and sin. They compute what the HF modules compute (RoPE
bit for bit; a norm's sum of squares and a joined product's sums in another order: within a few ulps in fp32, a last
bf16 bit at a rounding tie in bf16; tests/model_runtime/test_gemma3.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention, Gemma3MLP, Gemma3RMSNorm
from transformers.models.llama.modeling_llama import eager_attention_forward

from promptcache.model_runtime import avx2
from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.loading.architectures import head_dim_of
from promptcache.model_runtime.loading.fused_layers import joined_projection

log = logging.getLogger(__name__)

_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")


class FusedGemmaRMSNorm(torch.nn.Module):
    """Gemma's RMSNorm, `(x * rsqrt(mean(x^2) + eps)) * (1 + w)` in fp32 (rounded once to x's dtype), in one pass: the
    RMSNorm with 1 + w made once (`scale`, not in the state dict: `weight` stays the checkpoint's)."""

    scale: torch.Tensor

    def __init__(self, norm: Any, ops: Any) -> None:  # a Hugging Face Gemma3RMSNorm; gemma_ops()
        super().__init__()
        self.weight, self.eps, self.ops = norm.weight, float(norm.eps), ops
        self.register_buffer("scale", (1.0 + norm.weight.detach().float()).contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., H] (any strides) -> [..., H]: rows in x's logical order
        return self.ops.rms_norm(x.reshape(-1, x.shape[-1]), self.scale, self.eps).view(x.shape)


class FusedGemmaAttention(torch.nn.Module):
    """Gemma3Attention with q|k|v as one projection and q/k normalised per head and rotated in one pass each; called
    as the HF module is (its decoder layer passes the layer type's cos and sin), the cache update and attention
    function the model's, with the HF module's arguments (its window included)."""

    def __init__(self, attention: Any, ops: Any) -> None:  # a Hugging Face Gemma3Attention; gemma_ops()
        super().__init__()
        config = attention.config
        self.config, self.layer_idx, self.ops = config, attention.layer_idx, ops
        self.head_dim, self.scaling, self.is_causal = attention.head_dim, attention.scaling, attention.is_causal
        self.num_heads, self.num_key_value_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_key_value_groups, self.sliding_window = attention.num_key_value_groups, attention.sliding_window
        self.layer_type, self.is_sliding = attention.layer_type, attention.is_sliding
        self.JOINED_PROJECTIONS = {"qkv_proj": _QKV}  # read by quantize_linears: the stored blocks side by side
        self.qkv_proj = joined_projection(attention, _QKV)
        self.o_proj = attention.o_proj
        self.q_norm = FusedGemmaRMSNorm(attention.q_norm, ops)
        self.k_norm = FusedGemmaRMSNorm(attention.k_norm, ops)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, cache: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
        batch, length, _ = hidden_states.shape
        rows, dim, heads, kv_heads = batch * length, self.head_dim, self.num_heads, self.num_key_value_heads
        qkv = self.qkv_proj(hidden_states.reshape(rows, -1))         # [rows, (H + 2 H_kv) D]
        for norm, first, count in ((self.q_norm, 0, heads), (self.k_norm, heads, kv_heads)):
            part = qkv[:, first * dim: (first + count) * dim]          # [rows, count D]: each head a row of D
            part.copy_(self.ops.rms_norm(part.reshape(rows * count, dim), norm.scale, norm.eps).view(rows, -1))
        # cos, sin: [B or 1, T, D] -> [rows, D]
        cos, sin = (t.expand(batch, length, dim).reshape(rows, dim).contiguous() for t in position_embeddings)
        query, key = self.ops.rope_qk(qkv, cos, sin, heads, kv_heads)  # [rows, H | H_kv, D]
        value = qkv[:, (heads + kv_heads) * dim:].view(rows, kv_heads, dim)
        # [rows, heads, D] -> [B, heads, T, D] views, the layout the HF module hands to cache and attention
        query, key, value = (t.view(batch, length, -1, dim).transpose(1, 2) for t in (query, key, value))
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = attend(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
                        sliding_window=self.sliding_window, **kwargs)
        return self.o_proj(out.reshape(batch, length, -1).contiguous()), None


class FusedGemmaMLP(torch.nn.Module):
    """`down(gelu_tanh(gate(x)) * up(x))` with gate and up as one projection; `gelu_mul(gate_up [N, 2I]) -> [N, I]`
    one pass for the gated product where given (bf16), else the HF module's activation and a multiply."""

    def __init__(self, mlp: Any, gelu_mul: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        super().__init__()  # mlp: a Hugging Face Gemma3MLP
        self.JOINED_PROJECTIONS = {"gate_up_proj": _GATE_UP}
        self.gate_up_proj = joined_projection(mlp, _GATE_UP)
        self.down_proj, self.act_fn, self.intermediate_size = mlp.down_proj, mlp.act_fn, mlp.intermediate_size
        self.gelu_mul = gelu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)                                # [..., 2 I]
        if self.gelu_mul is not None:
            return self.down_proj(self.gelu_mul(gate_up.reshape(-1, gate_up.shape[-1])).view(*x.shape[:-1], -1))
        gate, up = gate_up[..., : self.intermediate_size], gate_up[..., self.intermediate_size:]
        return self.down_proj(self.act_fn(gate) * up)


class Bf16GemmaOps:
    """The ops the fused modules take, for bf16 weights, from the bf16 kernels: Gemma's RMSNorm
    `bf16(x * rsqrt(mean(x^2) + eps) * scale)` in fp32 (`rms_norm_scaled`: HF's module upcasts and rounds once, where
    the Llama norm rounds the normalised x first; one pass instead of torch's upcast, norm and cast: a decode step's
    109 norms 3.3 -> 1.0 ms), the RoPE (the HF formula, rounded where it rounds) and the MLP's GELU-tanh gated product
    (`gelu_mul`: gelu_tanh rounded to bf16, times up, as the module's two ops; a prefill's 8 % -> ~1 %)."""

    def __init__(self, kernel_ops: bf16_kernel.FusedOps) -> None:
        self.rope_qk, self.rms_norm = kernel_ops.rope_qk, kernel_ops.rms_norm_scaled
        self.gelu_mul = kernel_ops.gelu_tanh_mul


def gemma_ops(parameter: torch.Tensor) -> Any:
    """The ops for Gemma weights like `parameter` on a CPU: the AVX2 library's in fp32, Bf16GemmaOps in bf16 with the
    bf16 kernels; None elsewhere (the HF modules)."""
    if parameter.device.type != "cpu":
        return None
    if parameter.dtype == torch.float32:
        return avx2.fused_ops()
    if parameter.dtype == torch.bfloat16 and bf16_kernel.prepare() and (kernel_ops := bf16_kernel.fused_ops()):
        return Bf16GemmaOps(kernel_ops)
    return None


def fuse_gemma(model: Any) -> int:
    """A Gemma 3 text model on a CPU with the ops for its dtype (`gemma_ops`): its RMSNorms, attention blocks and MLPs
    swapped for the fused ones in place; returns how many modules (0 elsewhere). Call before quantizing: the joined
    projections are plain Linears."""
    parameter = next(model.parameters())
    # the kernels' vector widths: fp32 rows in 8s; bf16's RoPE takes heads in multiples of 32
    lanes = 32 if parameter.dtype == torch.bfloat16 else 8
    if (getattr(model.config, "model_type", None) != "gemma3_text" or model.config.hidden_size % 8
            or head_dim_of(model.config) % lanes or (ops := gemma_ops(parameter)) is None):
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Gemma3Attention):
                setattr(parent, name, FusedGemmaAttention(child, ops))
            elif isinstance(child, Gemma3MLP):
                # the kernel takes gate|up rows in 32s (two halves of 16 fp32 lanes each)
                one_pass = isinstance(ops, Bf16GemmaOps) and child.intermediate_size % 16 == 0
                setattr(parent, name, FusedGemmaMLP(child, ops.gelu_mul if one_pass else None))
            elif isinstance(child, Gemma3RMSNorm):
                setattr(parent, name, FusedGemmaRMSNorm(child, ops))
            else:
                continue
            swapped += 1
    log.info("fused %d Gemma modules (%s)", swapped, type(ops).__name__)
    return swapped

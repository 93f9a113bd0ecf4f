"""Fused Llama/Mistral/Qwen2 decoder layers (`fuse_layers`, at load): q|k|v and gate|up as one projection each, RMSNorm,
RoPE and the SiLU gate as one-pass bf16 kernels on AVX512-BF16 CPUs (csrc/fused_bf16.cpp), fewer torch ops on a GPU
(torch_layer_ops.py), or the batch-invariant ops of deterministic serving (model_runtime/deterministic/). They round
where the HF modules do: equal outputs but for rare last-bit ties."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, eager_attention_forward
from transformers.models.mistral.modeling_mistral import MistralAttention, MistralMLP, MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2MLP, Qwen2RMSNorm

from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.loading import torch_layer_ops

if TYPE_CHECKING:
    from promptcache.model_runtime.packed_attention import BatchContext

log = logging.getLogger(__name__)


class LayerOps(Protocol):
    """The fused modules' element-wise ops: `bf16_kernel.FusedOps` on a CPU, `torch_layer_ops` on a GPU."""

    @property
    def rms_norm(self) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]: ...
    @property
    def silu_mul(self) -> Callable[[torch.Tensor], torch.Tensor]: ...
    @property
    def rope_qk(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], list[torch.Tensor]]: ...

_NORMS = (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm)
_MLPS = (LlamaMLP, MistralMLP, Qwen2MLP)
_ATTENTIONS = (LlamaAttention, MistralAttention, Qwen2Attention)  # all use Llama's eager_attention_forward
_LANES = 16  # the kernels' vector width in elements: feature sizes must be multiples of it


class FusedRMSNorm(torch.nn.Module):
    """LlamaRMSNorm (and its Mistral/Qwen2 twins) in one pass: `weight * bf16(x * rsqrt(mean(x^2) + eps))`."""

    def __init__(self, norm: Any, ops: LayerOps) -> None:  # a Hugging Face RMSNorm (duck-typed)
        super().__init__()
        self.weight, self.eps, self.ops = norm.weight, float(norm.variance_epsilon), ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., H] -> [..., H]
        return self.ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)


class FusedGatedMLP(torch.nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate and up as one projection and SiLU-times-up in one pass."""

    # The source layers of each joined projection: a checkpoint's quantized blocks are found by their names.
    JOINED_PROJECTIONS: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, mlp: Any, ops: LayerOps) -> None:  # a Hugging Face gated MLP (duck-typed)
        super().__init__()
        self.gate_up_proj = _concatenated(mlp.gate_proj, mlp.up_proj)
        self.down_proj, self.ops = mlp.down_proj, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., hidden] -> gate|up [rows, 2 * inter] -> [rows, inter] -> [..., hidden]
        gate_up = self.gate_up_proj(x.reshape(-1, x.shape[-1]))
        return self.down_proj(self.ops.silu_mul(gate_up)).view(*x.shape[:-1], -1)


class FusedAttention(torch.nn.Module):
    """A Llama/Mistral/Qwen2 attention block with q|k|v as one projection and RoPE on q and k in one pass; the cache
    update and attention function are the model's, called as the HF module calls them (the same tensors)."""

    JOINED_PROJECTIONS: ClassVar[dict[str, tuple[str, ...]]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, attention: Any, ops: LayerOps) -> None:  # a Hugging Face attention (duck-typed)
        super().__init__()
        config = attention.config
        self.config, self.layer_idx, self.ops = config, attention.layer_idx, ops
        self.head_dim, self.scaling = attention.head_dim, attention.scaling
        self.num_heads, self.num_key_value_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_key_value_groups, self.is_causal = attention.num_key_value_groups, True
        self.qkv_proj = _concatenated(attention.q_proj, attention.k_proj, attention.v_proj)
        self.o_proj = attention.o_proj

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, cache=None, **kwargs) -> tuple[torch.Tensor, None]:
        batch, length, _ = hidden_states.shape
        rows, dim = batch * length, self.head_dim
        qkv = self.qkv_proj(hidden_states.reshape(rows, -1))       # [rows, (H + 2 H_kv) D]
        # cos, sin: [B or 1, T, D] -> [rows, D]
        cos, sin = (t.expand(batch, length, dim).reshape(rows, dim).contiguous() for t in position_embeddings)
        query, key = self.ops.rope_qk(qkv, cos, sin, self.num_heads, self.num_key_value_heads)  # [rows, H|H_kv, D]
        value = qkv[:, (self.num_heads + self.num_key_value_heads) * dim:].view(rows, -1, dim)
        # [rows, heads, D] -> [B, heads, T, D] views, the layout the HF module hands to cache and attention
        query, key, value = (t.view(batch, length, -1, dim).transpose(1, 2) for t in (query, key, value))
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = attend(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(batch, length, -1).contiguous()), None


_FUSED = ((_NORMS, FusedRMSNorm), (_MLPS, FusedGatedMLP), (_ATTENTIONS, FusedAttention))  # replaced HF modules, fused


# (input_ids [1, Q], position_ids [1, Q], cache) -> the final norm's hidden states [1, Q, hidden]
StackForward = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


def fused_stack_forward(base_model: Any) -> StackForward | None:
    """The decoder stack of a model whose layers are all fused as one plain loop, the HF model's arithmetic in
    its order (checked bit for bit), or None where some layer is not fused. For the engine's batch steps (no
    mask): the HF forward's plumbing took ~0.3-0.6 ms of a 21 ms SmolLM2 decode step (docs/benchmarks.md)."""
    layers = _fused_layers(base_model)
    if layers is None:
        return None

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        hidden = base_model.embed_tokens(input_ids)                           # [1, Q, hidden]
        position_embeddings = base_model.rotary_emb(hidden, position_ids=position_ids)
        for layer in layers:
            hidden = hidden + layer.self_attn(layer.input_layernorm(hidden), position_embeddings, None, cache)[0]
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return base_model.norm(hidden)

    return forward


# (input_ids [1, B], position_ids [1, B], the step's BatchContext) -> the final norm's hidden states [1, B, hidden]
DecodeForward = Callable[[torch.Tensor, torch.Tensor, "BatchContext"], torch.Tensor]


def decode_stack_forward(base_model: Any) -> DecodeForward | None:
    """`fused_stack_forward`'s ops in one loop for a step the decode kernel attends (`decode_batch.kernel_takes`), KV
    written through the step's `writes`, without the module calls that bind a small decode step (None: some unfused)."""
    layers = _fused_layers(base_model)
    if layers is None:
        return None
    first = layers[0].self_attn
    heads, kv_heads, dim, scale = first.num_heads, first.num_key_value_heads, first.head_dim, first.scaling

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor, context: BatchContext) -> torch.Tensor:
        rows, ops = input_ids.shape[1], first.ops  # read per step: a profiler may swap in labelled ops
        hidden = base_model.embed_tokens(input_ids)                           # [1, B, hidden]
        cos, sin = (t[0].contiguous() for t in base_model.rotary_emb(hidden, position_ids=position_ids))  # [B, D]
        hidden = hidden[0]                                                    # [B, hidden]
        context.prepare(hidden.device)
        writes = context.writes
        assert writes is not None, "prepare() makes the pass's writes"
        for layer in layers:
            attention, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
            qkv = attention.qkv_proj(ops.rms_norm(hidden, norm.weight, norm.eps))  # [B, (H + 2 H_kv) D]
            query, key = ops.rope_qk(qkv, cos, sin, heads, kv_heads)             # [B, H, D], [B, H_kv, D]
            value = qkv[:, (heads + kv_heads) * dim:].view(rows, kv_heads, dim)
            for write in writes:  # [H_kv, B, D] views, as the cache's update receives them
                write(attention.layer_idx, key.transpose(0, 1), value.transpose(0, 1))
            attended = context.decode_batch(query).attend(query, attention.layer_idx, scale)[0]  # [B, H, D]
            hidden = hidden + attention.o_proj(attended.view(rows, heads * dim))
            norm = layer.post_attention_layernorm
            hidden = hidden + mlp.down_proj(ops.silu_mul(mlp.gate_up_proj(ops.rms_norm(hidden, norm.weight, norm.eps))))
        return base_model.norm(hidden).unsqueeze(0)

    return forward


def fused_decoder_layers(base_model: Any) -> list[Any] | None:
    """The model's decoder layers when every one is fused (their joined projections and `ops`), else None."""
    return _fused_layers(base_model)


def _fused_layers(base_model: Any) -> list[Any] | None:
    """The model's decoder layers when every one is fused, else None."""
    if not _fusable_architecture(base_model.config):  # another architecture (GPT-2's blocks are `h`, other parts)
        return None
    layers = list(base_model.layers[: base_model.config.num_hidden_layers])
    if not layers or not all(isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedGatedMLP)
                             and isinstance(layer.input_layernorm, FusedRMSNorm)
                             and isinstance(layer.post_attention_layernorm, FusedRMSNorm) for layer in layers):
        return None
    return layers


def fuse_layers(model: torch.nn.Module, ops: LayerOps | None = None) -> int:
    """Swap a Llama/Mistral/Qwen2 model's norms, attention blocks and gated MLPs for fused ones in place; returns how
    many (0 where no ops or shapes apply). `ops`: these (any shapes of the architecture), else the bf16 kernels' or
    torch's for the weights' device and dtype. Call before packing: the joined projections are plain `nn.Linear`s."""
    if ops is None:
        ops = _layer_ops(next(model.parameters())) if _fusable(model.config) else None
    elif not _fusable_architecture(model.config):
        return 0
    if ops is None:
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            fused = next((kind for replaced, kind in _FUSED if isinstance(child, replaced)), None)
            if fused is not None:
                setattr(parent, name, fused(child, ops))
                swapped += 1
    log.info("fused %d decoder modules (%s)", swapped, "torch ops" if ops is torch_layer_ops else type(ops).__name__)
    return swapped


def _layer_ops(parameter: torch.Tensor) -> LayerOps | None:
    """The ops for weights like `parameter`: torch's on a GPU (any dtype), the bf16 kernels in bf16 on a CPU."""
    if parameter.device.type == "cuda":
        return torch_layer_ops
    if parameter.dtype != torch.bfloat16 or parameter.device.type != "cpu" or not bf16_kernel.prepare():
        return None
    return bf16_kernel.fused_ops()


def _fusable(config) -> bool:
    """Shapes the bf16 kernels implement: the architecture's, head dim % 32, hidden and intermediate % 16."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (_fusable_architecture(config) and head_dim % (2 * _LANES) == 0 and config.hidden_size % _LANES == 0
            and config.intermediate_size % _LANES == 0)


def _fusable_architecture(config) -> bool:
    """The layers the fused modules replace: Llama, Mistral and Qwen2 with SiLU gating and full-head RoPE."""
    return (config.model_type in ("llama", "mistral", "qwen2") and config.hidden_act == "silu"
            and getattr(config, "partial_rotary_factor", 1.0) == 1.0)


def _concatenated(*linears: torch.nn.Linear) -> torch.nn.Linear:
    """One Linear whose output is the given layers' outputs side by side (weights and biases stacked)."""
    weight = torch.cat([linear.weight.detach() for linear in linears])  # [sum(out), in]
    has_bias = linears[0].bias is not None
    joined = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        joined.weight.copy_(weight)
        if has_bias:
            joined.bias.copy_(torch.cat([linear.bias.detach() for linear in linears]))
    return joined.requires_grad_(False)

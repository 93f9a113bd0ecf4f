"""Fused decoder layers of the RoPE architectures (`fuse_layers`, at load; architectures.py names each one's parts):
q|k|v and gate|up as one projection each (joined at load where the checkpoint keeps them apart, taken as they are
where it joins them: Phi-3), RMSNorm, RoPE (after Qwen3's per-head q/k RMSNorm) and the SiLU gate as one-pass bf16
kernels on AVX512-BF16 CPUs (csrc/fused_bf16.cpp), fewer torch ops on a GPU (torch_layer_ops.py), or the
batch-invariant ops of deterministic serving (model_runtime/deterministic/). They round where the HF modules do:
equal outputs but for rare last-bit ties."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from promptcache.model_runtime import avx2
from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.loading import torch_layer_ops
from promptcache.model_runtime.loading.architectures import ARCHITECTURES, Architecture, head_dim_of, rotary_fraction

if TYPE_CHECKING:
    from promptcache.model_runtime.packed_attention import BatchContext

log = logging.getLogger(__name__)


class LayerOps(Protocol):
    """The fused modules' element-wise ops: `bf16_kernel.FusedOps` / `avx2.FusedOps` on a CPU (bf16 / fp32),
    `torch_layer_ops` on a GPU."""

    @property
    def rms_norm(self) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]: ...
    @property
    def silu_mul(self) -> Callable[[torch.Tensor], torch.Tensor]: ...
    @property
    def rope_qk(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], list[torch.Tensor]]: ...

_LANES = 16  # the kernels' vector width in elements: feature sizes must be multiples of it


class FusedRMSNorm(torch.nn.Module):
    """LlamaRMSNorm (and its Mistral/Qwen2/Qwen3/Phi-3 twins) in one pass: `weight * bf16(x * rsqrt(mean(x^2) +
    eps))`."""

    def __init__(self, norm: Any, ops: LayerOps) -> None:  # a Hugging Face RMSNorm (duck-typed)
        super().__init__()
        self.weight, self.eps, self.ops = norm.weight, float(norm.variance_epsilon), ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., H] -> [..., H]
        return self.ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)


class FusedGatedMLP(torch.nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate and up as one projection and SiLU-times-up in one pass."""

    def __init__(self, mlp: Any, ops: LayerOps, arch: Architecture) -> None:  # a Hugging Face gated MLP
        super().__init__()
        # The checkpoint's layers behind the joined projection (quantize_linears finds their stored blocks by name).
        self.JOINED_PROJECTIONS = {"gate_up_proj": arch.gate_up}
        self.gate_up_proj = joined_projection(mlp, arch.gate_up)
        self.down_proj, self.ops = mlp.down_proj, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., hidden] -> gate|up [rows, 2 * inter] -> [rows, inter] -> [..., hidden]
        gate_up = self.gate_up_proj(x.reshape(-1, x.shape[-1]))
        return self.down_proj(self.ops.silu_mul(gate_up)).view(*x.shape[:-1], -1)


class FusedAttention(torch.nn.Module):
    """An attention block of a RoPE architecture with q|k|v as one projection, q and k normalised per head where the
    architecture does (Qwen3) and rotated in one pass; the cache update and attention function are the model's,
    called as the HF module calls them (the same tensors)."""

    def __init__(self, attention: Any, ops: LayerOps, arch: Architecture) -> None:  # a Hugging Face attention
        super().__init__()
        config = attention.config
        self.config, self.layer_idx, self.ops = config, attention.layer_idx, ops
        self.head_dim, self.scaling = attention.head_dim, attention.scaling
        self.num_heads, self.num_key_value_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_key_value_groups, self.is_causal = attention.num_key_value_groups, True
        self.JOINED_PROJECTIONS = {"qkv_proj": arch.qkv}  # read by quantize_linears, as the MLP's
        self.qkv_proj = joined_projection(attention, arch.qkv)
        self.o_proj = attention.o_proj
        # Qwen3: RMSNorm over each head's D dimensions of q and k, before RoPE ([D] weights, the model's eps).
        self.q_norm = FusedRMSNorm(attention.q_norm, ops) if arch.qk_norm else None
        self.k_norm = FusedRMSNorm(attention.k_norm, ops) if arch.qk_norm else None

    def rotated_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
        """qkv [N, (H + 2 H_kv) D], cos/sin [N, D] -> [q [N, H, D], k [N, H_kv, D]] as the HF module computes them:
        normalised per head where the architecture says, then rotated."""
        heads, kv_heads, dim = self.num_heads, self.num_key_value_heads, self.head_dim
        if self.q_norm is not None and self.k_norm is not None:
            rows, ops = qkv.shape[0], self.ops
            # The ops take [rows, width] matrices: each head a row of D. Written back into this pass's own qkv.
            for norm, first, count in ((self.q_norm, 0, heads), (self.k_norm, heads, kv_heads)):
                part = qkv[:, first * dim: (first + count) * dim]                # [N, count D] strided view
                part.copy_(ops.rms_norm(part.reshape(rows * count, dim), norm.weight, norm.eps).view(rows, -1))
        return self.ops.rope_qk(qkv, cos, sin, heads, kv_heads)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, cache=None, **kwargs) -> tuple[torch.Tensor, None]:
        batch, length, _ = hidden_states.shape
        rows, dim = batch * length, self.head_dim
        qkv = self.qkv_proj(hidden_states.reshape(rows, -1))       # [rows, (H + 2 H_kv) D]
        # cos, sin: [B or 1, T, D] -> [rows, D]
        cos, sin = (t.expand(batch, length, dim).reshape(rows, dim).contiguous() for t in position_embeddings)
        query, key = self.rotated_qk(qkv, cos, sin)                 # [rows, H|H_kv, D]
        value = qkv[:, (self.num_heads + self.num_key_value_heads) * dim:].view(rows, -1, dim)
        # [rows, heads, D] -> [B, heads, T, D] views, the layout the HF module hands to cache and attention
        query, key, value = (t.view(batch, length, -1, dim).transpose(1, 2) for t in (query, key, value))
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = attend(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(batch, length, -1).contiguous()), None


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
            query, key = attention.rotated_qk(qkv, cos, sin)                    # [B, H, D], [B, H_kv, D]
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
    if _fusable_arch(base_model.config) is None:  # another architecture (GPT-2's blocks are `h`, other parts)
        return None
    layers = list(base_model.layers[: base_model.config.num_hidden_layers])
    if not layers or not all(isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedGatedMLP)
                             and isinstance(layer.input_layernorm, FusedRMSNorm)
                             and isinstance(layer.post_attention_layernorm, FusedRMSNorm) for layer in layers):
        return None
    return layers


def fuse_layers(model: Any, ops: LayerOps | None = None) -> int:
    """Swap the norms, attention blocks and gated MLPs of a model whose architecture fuses (architectures.py) for
    fused ones in place (Gemma 3's own: fused_gemma.py); returns how many (0 where no ops or shapes apply). `ops`:
    these (any shapes of the
    architecture), else the bf16 kernels' or torch's for the weights' device and dtype. Call before packing: the
    joined projections are plain `nn.Linear`s."""
    arch = _fusable_arch(model.config)
    if ops is None and arch is not None and _kernel_shapes(model.config):
        ops = _layer_ops(next(model.parameters()))
    if ops is None or arch is None:
        return 0
    base = model.base_model
    for layer in base.layers[: model.config.num_hidden_layers]:
        layer.self_attn = FusedAttention(layer.self_attn, ops, arch)
        layer.mlp = FusedGatedMLP(layer.mlp, ops, arch)
        layer.input_layernorm = FusedRMSNorm(layer.input_layernorm, ops)
        layer.post_attention_layernorm = FusedRMSNorm(layer.post_attention_layernorm, ops)
    base.norm = FusedRMSNorm(base.norm, ops)
    swapped = 4 * model.config.num_hidden_layers + 1
    log.info("fused %d decoder modules (%s)", swapped, "torch ops" if ops is torch_layer_ops else type(ops).__name__)
    return swapped


def _layer_ops(parameter: torch.Tensor) -> LayerOps | None:
    """The ops for weights like `parameter`: torch's on a GPU (any dtype); on a CPU the bf16 kernels' in bf16, the AVX2
    library's in fp32 (None where not loaded: the HF modules)."""
    if parameter.device.type == "cuda":
        return torch_layer_ops
    if parameter.dtype == torch.float32 and parameter.device.type == "cpu":
        return avx2.fused_ops()
    if parameter.dtype != torch.bfloat16 or parameter.device.type != "cpu" or not bf16_kernel.prepare():
        return None
    return bf16_kernel.fused_ops()


def _kernel_shapes(config: Any) -> bool:
    """Shapes the bf16 kernels implement: head dim % 32, hidden and intermediate % 16."""
    return (head_dim_of(config) % (2 * _LANES) == 0 and config.hidden_size % _LANES == 0
            and config.intermediate_size % _LANES == 0)


def _fusable_arch(config: Any) -> Architecture | None:
    """The architecture of a model whose layers the fused modules replace: a fusable one (architectures.py) with SiLU
    gating and RoPE over whole heads (partial rotary, as some Phi-3 configs have, stays with the HF modules)."""
    arch = ARCHITECTURES.get(getattr(config, "model_type", None) or "")
    if arch is None or not arch.fusable or config.hidden_act != "silu" or rotary_fraction(config) != 1.0:
        return None
    return arch


def joined_projection(module: torch.nn.Module, names: tuple[str, ...]) -> torch.nn.Module:
    """`module`'s projection whose output is the layers `names`' outputs side by side: the one layer where the
    checkpoint joins them already (kept as it is), else a new Linear with their weights and biases stacked."""
    linears = [getattr(module, name) for name in names]
    if len(linears) == 1:
        return linears[0]
    weight = torch.cat([linear.weight.detach() for linear in linears])  # [sum(out), in]
    has_bias = linears[0].bias is not None
    joined = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        joined.weight.copy_(weight)
        if has_bias:
            joined.bias.copy_(torch.cat([linear.bias.detach() for linear in linears]))
    return joined.requires_grad_(False)

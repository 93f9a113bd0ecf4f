"""The architectures promptcache serves, each described once (`ARCHITECTURES`), and the config check that refuses the
rest before any weight is read (`check_architecture`): another model type, RoPE whose angles rescale with the
sequence's length, or logit soft-capping. Module KV computed at fixed positions is reused verbatim, so a model must give
a token the same keys and values whatever follows it and however long the sequence grows. A sliding window does not
change a token's keys, only which of them a later token reads: `layer_windows` names it per layer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from promptcache.model_runtime.errors import UnsupportedModelError


@dataclass(frozen=True, slots=True)
class Architecture:
    """How one HF `model_type` is laid out, for the loader, the fused layers and the deterministic layout.

    A RoPE decoder (`uses_rope`) has Llama's skeleton: `base_model.layers[i]` with `self_attn`, `mlp`,
    `input_layernorm` and `post_attention_layernorm` (RMSNorm), a SiLU-gated MLP, `base_model.rotary_emb` and a
    final `norm`. What differs is named here: the linear layers whose outputs are q|k|v (`qkv`) and gate|up
    (`gate_up`) side by side — three and two in Llama, one each in Phi-3's checkpoint — and Qwen3's RMSNorm over each
    head of q and k before RoPE (`qk_norm`: the attention's `q_norm`, `k_norm`). GPT-2 (learned positions, `h`
    blocks) is served by its HF modules only: `fusable` False. So is Gemma 3's text model (`gemma3_text`): its
    embedding scaled by sqrt(hidden), (1 + w) RMSNorms before and after attention and MLP, GELU-tanh MLP, q/k RMSNorm,
    `query_pre_attn_scalar` scaling and a RoPE base per layer type (KeyShifter.of) stay the HF modules'; attention goes
    through the engine's function as every architecture's does."""

    model_type: str
    uses_rope: bool = True
    fusable: bool = True
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.fusable and not (self.uses_rope and self.qkv and self.gate_up):
            raise ValueError(f"{self.model_type}: fused layers need RoPE, q|k|v and gate|up projections")


ARCHITECTURES: Mapping[str, Architecture] = {arch.model_type: arch for arch in (
    Architecture("llama"),
    Architecture("mistral"),
    Architecture("qwen2"),
    Architecture("qwen3", qk_norm=True),
    Architecture("phi3", qkv=("qkv_proj",), gate_up=("gate_up_proj",)),
    Architecture("gpt2", uses_rope=False, fusable=False, qkv=(), gate_up=()),
    Architecture("gemma3_text", fusable=False, qk_norm=True),
)}
SUPPORTED_ARCHITECTURES = frozenset(ARCHITECTURES)

# Model types people ask for that are refused on purpose, and why (the error names it).
_REFUSED_WHY = {
    "gemma2": "its attention and final logit soft-capping are not implemented; Gemma 3's text models are served",
    "gemma3": "the multimodal Gemma 3 wrapper (vision tower, image tokens) is not served; its text-only checkpoints "
              "(model_type gemma3_text, as gemma-3-270m and gemma-3-1b) are",
    "phi": "Phi-1/2's parallel attention and MLP block over one LayerNorm is not implemented",
}
# RoPE whose angles depend on the sequence's length (HF recomputes the frequencies from the largest position in the
# pass): stored module keys would carry other angles than a full prefill's, and a batch would change them.
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})
# Config settings whose effect the engine does not compute (Gemma 2 sets both; Gemma 3 neither): the runner takes the
# logits straight from the head, and the attention paths have no soft-capping.
_REFUSED_SETTINGS = {
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
    "use_bidirectional_attention": "bidirectional attention (an embedding model, not a causal LM)",
}


def architecture_of(hf_config: Any) -> Architecture:
    """The description of `hf_config`'s model type; raises UnsupportedModelError naming it when there is none."""
    model_type = getattr(hf_config, "model_type", None)
    found = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if found is None:
        why = _REFUSED_WHY.get(model_type) if isinstance(model_type, str) else None
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported{f' ({why})' if why else ''}; "
                                    f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    return found


def check_architecture(hf_config: Any) -> Architecture:
    """`hf_config`'s architecture when promptcache serves it as configured; raises UnsupportedModelError for another
    model type, a setting in _REFUSED_SETTINGS, a layer kind other than full or sliding-window attention, or
    length-dependent RoPE."""
    arch = architecture_of(hf_config)
    model_type = arch.model_type
    for setting, what in _REFUSED_SETTINGS.items():
        if getattr(hf_config, setting, None):
            raise UnsupportedModelError(f"{model_type} model with {what} ({setting}={getattr(hf_config, setting)!r}) "
                                        "is not supported")
    layer_types = getattr(hf_config, "layer_types", None) or ()
    if unknown := sorted(set(layer_types) - set(_WINDOW_OF_LAYER_TYPE)):
        raise UnsupportedModelError(f"{model_type} model with layer types {unknown} is not supported; promptcache "
                                    "serves full_attention and sliding_attention layers")
    if arch.uses_rope and (rope_type := length_dependent_rope(hf_config)) is not None:
        raise UnsupportedModelError(f"{model_type} model with {rope_type} RoPE scaling is not supported: its angles "
                                    "change with the sequence's length, so cached keys would not be a full "
                                    "prefill's; the same model with plain RoPE is served")
    return arch


# Whether a layer of each kind slides (transformers' `layer_types` names).
_WINDOW_OF_LAYER_TYPE = {"full_attention": False, "sliding_attention": True}


def layer_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Per decoder layer, the sliding window W its attention has (None: full attention): a query at position q reads
    a key at position k only if q - k < W, as transformers' sliding-window mask (`kv_idx > q_idx - W`). Configs that
    list `layer_types` (Qwen2/Qwen3, Gemma 3) slide in their "sliding_attention" layers; others with a
    `sliding_window` (Mistral, Phi-3) in every layer. A window no shorter than the model's positions never cuts: None.
    """
    num_layers: int = hf_config.num_hidden_layers  # GPT-2's n_layer is aliased
    window = getattr(hf_config, "sliding_window", None)
    if not window or window >= max_positions(hf_config):
        return (None,) * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return (int(window),) * num_layers
    if len(layer_types) != num_layers:
        raise UnsupportedModelError(f"{hf_config.model_type} config lists {len(layer_types)} layer types for "
                                    f"{num_layers} layers")
    return tuple(int(window) if _WINDOW_OF_LAYER_TYPE.get(kind) else None for kind in layer_types)


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE settings (transformers 5's `rope_parameters`, else the older `rope_scaling`), `rope_type`
    filled in from the old `type` key; {} when it has none."""
    found = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if not isinstance(found, dict):
        return {}
    return {**found, "rope_type": found.get("rope_type", found.get("type", "default"))}


def rope_types(hf_config: Any) -> frozenset[str]:
    """Every `rope_type` the config's RoPE uses: one, or one per layer type where `rope_parameters` maps each type
    (Gemma 3: "sliding_attention", "full_attention") to its own settings."""
    found = getattr(hf_config, "rope_parameters", None)
    layer_types = getattr(hf_config, "layer_types", None) or ()
    if isinstance(found, dict) and layer_types and all(isinstance(found.get(kind), dict) for kind in layer_types):
        return frozenset(str(found[kind].get("rope_type", found[kind].get("type", "default"))) for kind in layer_types)
    return frozenset({str(rope_parameters(hf_config)["rope_type"]) if rope_parameters(hf_config) else "default"})


def length_dependent_rope(hf_config: Any) -> str | None:
    """The config's RoPE type that rescales with the sequence's length (LENGTH_DEPENDENT_ROPE), or None."""
    return next(iter(sorted(rope_types(hf_config) & LENGTH_DEPENDENT_ROPE)), None)


def rotary_fraction(hf_config: Any) -> float:
    """The fraction of each head RoPE rotates (Phi-3's and others' `partial_rotary_factor`; 1.0: whole heads)."""
    return float(rope_parameters(hf_config).get("partial_rotary_factor",
                                                getattr(hf_config, "partial_rotary_factor", None) or 1.0))


def max_positions(hf_config: Any) -> int:
    """Positions the model was trained for (GPT-2 calls it n_positions, aliased on recent configs)."""
    positions = getattr(hf_config, "max_position_embeddings", None)
    return int(positions) if positions else int(getattr(hf_config, "n_positions", 1024))


def head_dim_of(hf_config: Any) -> int:
    """Dimensions of one attention head (an explicit `head_dim`, as Qwen3 has, else hidden / heads)."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads

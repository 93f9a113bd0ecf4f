"""Load Hugging Face causal LMs (local path or hub id) and describe them for the runtime.

Supported: Llama, Mistral, Qwen2 (RoPE, grouped-query attention) and GPT-2 (learned positions), with
full attention only — a model whose sliding window is active is refused (module KV at arbitrary
positions assumes every token can see every earlier one). Other architectures are refused from the
config, before any weight is read.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from promptcache.model_runtime.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "gpt2"})
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "_attn_implementation_autoset",
                         "_attn_implementation", "torch_dtype", "dtype", "architectures", "use_cache"}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to load and how. `name_or_path=None` is the built-in SmolLM2-135M-Instruct."""

    name_or_path: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    trust_remote_code: bool = False
    cache_dir: str | None = None  # where the default model's converted weights are kept

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")


@dataclass(frozen=True, slots=True, eq=False)
class LoadedModel:
    """A model ready for the runtime, with the facts the runtime needs about it."""

    model: Any
    tokenizer: Any
    architecture: str
    name: str
    model_fingerprint: str
    tokenizer_fingerprint: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    uses_rope: bool
    max_positions: int
    eos_token_ids: tuple[int, ...]


def load_model(config: ModelConfig) -> LoadedModel:
    """Load model + tokenizer, refusing unsupported architectures before reading weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if config.device != "cpu" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {config.device!r} requested but CUDA is not available")
    if config.name_or_path is None:
        from promptcache.model_runtime.default_model import DEFAULT_MODEL_NAME, default_model_path

        path, name = str(default_model_path(config.cache_dir)), DEFAULT_MODEL_NAME
    else:
        path = name = config.name_or_path
    try:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=config.trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"cannot read a model config from {path!r}: {exc}") from None
    check_architecture(hf_config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[config.dtype], attn_implementation="sdpa", trust_remote_code=config.trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the model at {path!r}: {exc}") from None
    return wrap_model(model.to(config.device).eval(), tokenizer, name=name)


def check_architecture(hf_config: Any) -> None:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported; supported: "
                                    f"{sorted(SUPPORTED_ARCHITECTURES)}")
    window = getattr(hf_config, "sliding_window", None)
    uses_window = getattr(hf_config, "use_sliding_window", model_type == "mistral")
    max_positions = getattr(hf_config, "max_position_embeddings", None) or 0
    if uses_window and window is not None and window < max_positions:
        raise UnsupportedModelError(f"sliding-window attention (window {window}) is not supported; promptcache "
                                    "needs full attention")


def wrap_model(model: Any, tokenizer: Any, *, name: str) -> LoadedModel:
    """Describe an in-process model (tests, benchmarks) exactly as `load_model` would."""
    config = model.config
    check_architecture(config)
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError("promptcache needs a fast (Rust) tokenizer")
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 1024)
    dtype = str(model.dtype).removeprefix("torch.")
    return LoadedModel(
        model=model, tokenizer=tokenizer, architecture=config.model_type, name=name,
        model_fingerprint=_model_fingerprint(name, config, dtype),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        num_layers=config.num_hidden_layers, num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads, head_dim=head_dim,
        uses_rope=config.model_type != "gpt2", max_positions=max_positions,
        eos_token_ids=_eos_ids(model, tokenizer))


def _model_fingerprint(name: str, config: Any, dtype: str) -> str:
    data = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    h = hashlib.sha256(b"promptcache-model-v1")
    h.update(name.encode())
    h.update(json.dumps(data, sort_keys=True, default=str).encode())
    h.update(dtype.encode())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 over the full tokenizer definition and its chat template."""
    h = hashlib.sha256(b"promptcache-tokenizer-v1")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(tokenizer.get_vocab()).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    generation = getattr(model, "generation_config", None)
    for source in (getattr(generation, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.append(source)
        elif source:
            ids.extend(int(i) for i in source)
    if "<|im_end|>" in tokenizer.get_vocab():  # ChatML turns end here even when eos says otherwise
        ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return tuple(dict.fromkeys(ids))

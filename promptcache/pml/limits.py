"""Size limits applied while parsing PML, so hostile input fails fast and bounded."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PmlLimits:
    """Upper bounds for one PML document; every one is a user-configurable setting."""

    max_schema_bytes: int = 4 * 1024 * 1024
    max_prompt_bytes: int = 1024 * 1024
    max_depth: int = 32
    max_elements: int = 16384  # in one document: every element costs Python work, text does not
    max_modules: int = 4096
    max_scaffolds: int = 1024  # each is encoded jointly on upload, besides the modules' own encodings
    max_param_len: int = 8192
    max_schema_tokens: int = 1_000_000
    # Segment ids listed by all of a schema's encoding contexts together; they grow with the square of
    # the number of text pieces (docs/pml.md), this keeps a schema's layout to tens of MiB.
    max_context_ids: int = 1 << 22

    def __post_init__(self) -> None:
        for name in ("max_schema_bytes", "max_prompt_bytes", "max_depth", "max_elements", "max_modules",
                     "max_scaffolds", "max_param_len", "max_schema_tokens", "max_context_ids"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"PmlLimits.{name} must be a positive int, got {value!r}")

"""Size limits applied while parsing PML, so hostile input fails fast and bounded."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PmlLimits:
    """Upper bounds for one PML document; every one is a user-configurable setting."""

    max_schema_bytes: int = 4 * 1024 * 1024
    max_prompt_bytes: int = 1024 * 1024
    max_depth: int = 32
    max_modules: int = 4096
    max_param_len: int = 8192
    max_schema_tokens: int = 1_000_000

    def __post_init__(self) -> None:
        for name in ("max_schema_bytes", "max_prompt_bytes", "max_depth", "max_modules",
                     "max_param_len", "max_schema_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"PmlLimits.{name} must be a positive int, got {value!r}")

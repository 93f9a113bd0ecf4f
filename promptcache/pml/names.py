"""Name rules shared by schemas and prompts."""

from __future__ import annotations

import re

from promptcache.pml.errors import InvalidNameError

# Matched with fullmatch: `$` would also match before a final "\n", letting "kb\n" through.
NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
ROLE_TAGS = frozenset({"system", "user", "assistant"})
RESERVED_NAMES = frozenset({"schema", "prompt", "module", "union", "param", "parameter", "scaffold"}) | ROLE_TAGS


def is_valid_name(name: str) -> bool:
    """Whether `name` can name a schema, module or param (reserved tag names aside)."""
    return NAME_PATTERN.fullmatch(name) is not None


def check_name(name: str | None, *, element: str, line: int | None) -> str:
    """Return `name` if it is a valid module/param/schema name, else raise InvalidNameError."""
    if name is None:
        raise InvalidNameError(f"<{element}> needs a name attribute", line=line)
    if not is_valid_name(name):
        raise InvalidNameError(
            f"<{element}> name {name!r} is invalid: expected a letter or '_' followed by letters, "
            "digits, '_', '.' or '-'", line=line)
    if name in RESERVED_NAMES:
        raise InvalidNameError(f"<{element}> name {name!r} is a reserved PML tag name", line=line)
    return name

"""The runtime's string-valued enums: how a prompt's reused KV is treated (fidelity mode, positions, context)."""

from __future__ import annotations

import enum


class WireEnum(str, enum.Enum):
    """A str-valued enum that is its value wherever a str is expected (the wire, metric labels, keys):
    `enum.StrEnum`'s behaviour on Python 3.10 too, and hashed as its value, so a member and its value
    are one dict key (an enum hashes its name)."""

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return str(self.value)


class FidelityMode(WireEnum):
    """How much approximation a prompt reusing module KV out of its encoding context accepts
    (engine/reuse_plan.py)."""

    FAST = "fast"          # every cached segment reused as encoded
    BALANCED = "balanced"  # out-of-context segments' first k tokens recomputed in their actual context
    EXACT = "exact"        # only KV a full prefill would compute identically is reused


class PositionMode(WireEnum):
    """Where an approximate prompt's tokens sit."""

    CONTIGUOUS = "contiguous"  # each token at its rank among the prompt's positions (reused keys rotated)
    LAYOUT = "layout"          # the schema layout's positions, with gaps for modules not imported


class ContextMode(WireEnum):
    """Which encoding of an out-of-context module is reused."""

    SCHEMA = "schema"            # encoded after what the schema guarantees precedes it
    PREDECESSOR = "predecessor"  # encoded after that and the module just before it in the schema

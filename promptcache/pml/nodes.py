"""The typed, immutable schema tree. Positions are token positions; `end` is exclusive."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeAlias


@dataclass(frozen=True, slots=True)
class TextRun:
    """Literal schema text (or compiled role markup) at positions [start, end). `is_continuation`: tokenized
    as following the text before it, it tokenizes differently at a sequence start (TextEncoder)."""

    token_ids: tuple[int, ...]
    start: int
    line: int
    role_suffix_of: int | None = None  # section_id when this run closes a role section
    is_continuation: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class Param:
    """A slot of `length` positions for a runtime argument of module `module_path`. `scaffold_ids`: the
    tokens of its `scaffold="..."` text, in the slot's first positions while the module is encoded."""

    name: str
    length: int
    start: int
    line: int
    module_path: str
    scaffold_ids: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True, slots=True)
class Union:
    """Mutually exclusive member modules sharing one start; spans the longest member. `scaffold` names the
    member standing in the union's positions when the content after it is encoded (segments.py), if any."""

    members: tuple[Module, ...]
    default: str | None
    start: int
    end: int
    line: int
    scaffold: str | None = None


@dataclass(frozen=True, slots=True)
class RoleSection:
    """A `<system>`/`<user>`/`<assistant>` section: prefix run, children, suffix run."""

    role: str
    section_id: int
    owner_path: str
    children: tuple[Node, ...]
    start: int
    end: int
    line: int


@dataclass(frozen=True, slots=True)
class Module:
    """A named prompt module (the schema root has path ""). `scope` maps the names importable inside it
    (child modules and union members, through role sections) to their module; `params` its own parameters."""

    name: str
    path: str
    parent_path: str | None  # None for the root
    children: tuple[Node, ...]
    start: int
    end: int
    is_cached: bool
    line: int
    scope: Mapping[str, Module]
    params: Mapping[str, Param]
    unions: tuple[Union, ...]

    @property
    def num_positions(self) -> int:
        return self.end - self.start


Node: TypeAlias = "TextRun | Param | Union | RoleSection | Module"

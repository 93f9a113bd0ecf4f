"""A parsed schema: name rules, the typed immutable tree (positions are token positions; `end` is exclusive),
its cacheable segments with their encoding contexts, and scaffolds."""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeAlias

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


@dataclass(frozen=True, slots=True)
class Segment:
    """A maximal run of schema tokens owned by one module (path `owner`, "" for always-included text) at
    positions [start, end): the unit whose KV is cached. `context_ids`: the segments guaranteed to precede
    it in every prompt that includes it, its default KV's context. `is_continuation`: see TextRun."""

    segment_id: int
    token_ids: tuple[int, ...]
    start: int
    owner: str
    context_ids: tuple[int, ...]
    is_cached: bool
    role_suffix_of: int | None
    digest: str
    is_placeholder: bool = False  # a parameter slot's placeholder tokens: context only, never in a plan
    is_continuation: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def position_ids(self) -> range:
        return range(self.start, self.end)


@dataclass(frozen=True, slots=True)
class Scaffold:
    """Modules encoded jointly. `contexts` gives every segment of the group (the modules, their
    enclosing modules and the always-included text) its context when all the modules are imported."""

    name: str
    module_paths: tuple[str, ...]
    contexts: Mapping[int, tuple[int, ...]]
    line: int


@dataclass(frozen=True, slots=True, eq=False)
class Schema:
    """An immutable, validated schema with its global position layout."""

    name: str
    pml: str
    root: Module
    modules: Mapping[str, Module]
    segments: tuple[Segment, ...]
    scaffolds: tuple[Scaffold, ...]
    role_sections: Mapping[int, RoleSection]
    num_positions: int

    def segments_of(self, module_path: str) -> tuple[Segment, ...]:
        """The segments a module owns directly (not those of nested modules)."""
        return tuple(s for s in self.segments if s.owner == module_path)

    def context_digest(self, segment_ids: Iterable[int]) -> str:
        """SHA-256 naming an encoding context (its segments' tokens and positions, in order)."""
        h = hashlib.sha256(b"pml-context-v1")
        for segment_id in sorted(segment_ids, key=lambda i: (self.segments[i].start, i)):
            h.update(self.segments[segment_id].digest.encode())
        return h.hexdigest()

    def predecessor_context(self, segment_id: int, context_ids: Iterable[int]) -> tuple[int, ...] | None:
        """The context of a module segment's second encoding (fidelity "predecessor"): `context_ids` and the
        last other module's segment (not a placeholder) ending before it, in position order. None for text
        outside modules, without such a segment, or when that segment's own context is not what this context
        has before it (its KV in the chain would not be its stored encoding)."""
        segment, context = self.segments[segment_id], set(context_ids)
        if not segment.owner:
            return None
        before = [s for s in self.segments if s.owner not in ("", segment.owner) and s.is_cached
                  and not s.is_placeholder and s.end <= segment.start and s.segment_id not in context]
        if not before:
            return None
        previous = max(before, key=lambda s: s.end)
        if set(previous.context_ids) != {i for i in context if self.segments[i].start < previous.start}:
            return None
        return tuple(sorted({*context, previous.segment_id}, key=lambda i: (self.segments[i].start, i)))

    def always_included(self) -> list[tuple[int, int]]:
        """Position ranges [start, end) of the text every prompt of this schema includes (system
        prompt, role tags, text outside modules), adjacent segments merged, in position order."""
        ranges: list[tuple[int, int]] = []
        for segment in sorted((s for s in self.segments if not s.owner and not s.is_placeholder),
                              key=lambda s: s.start):
            if ranges and ranges[-1][1] == segment.start:
                ranges[-1] = (ranges[-1][0], segment.end)
            else:
                ranges.append((segment.start, segment.end))
        return ranges

    def module_table(self) -> list[dict[str, object]]:
        """One row per module: name, path, start, end (exclusive), positions spanned, its own param slots."""
        return [{"name": m.name, "path": m.path, "start": m.start, "end": m.end, "num_tokens": m.num_positions,
                 "params": [{"name": p.name, "start": p.start, "length": p.length} for p in m.params.values()]}
                for path, m in self.modules.items() if path]


def segment_digest(start: int, token_ids: tuple[int, ...]) -> str:
    h = hashlib.sha256(b"pml-segment-v1" + start.to_bytes(8, "little") + len(token_ids).to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))  # each id as 8 little-endian signed bytes
    return h.hexdigest()

"""Cut a schema tree into cacheable segments and give each its encoding contexts (design.md §3).

A segment's default context is every segment guaranteed to precede it whenever it is included:
always-included text before it and the text of its enclosing modules before it — never optional
siblings, union members or parameter slots. Contexts are prefix-closed (a context segment's own
context is the part of this context before it), so encoding a segment after the concatenated KV of
its context equals a full prefill of context + segment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from types import MappingProxyType

from lxml import etree

from promptcache.pml.errors import ScaffoldError
from promptcache.pml.nodes import Module, Node, Param, RoleSection, TextRun, Union
from promptcache.pml.schema import Scaffold, Segment, segment_digest


@dataclass(frozen=True, slots=True)
class _Leaf:
    run: TextRun
    owner: str
    is_cached: bool
    is_placeholder: bool = False


def build_segments(root: Module, placeholder_id: int | None = None) -> tuple[Segment, ...]:
    """Merge adjacent text runs of one owner into segments; compute default contexts.

    With `placeholder_id`, every parameter slot becomes a placeholder segment (that token repeated):
    the module text after a slot is encoded after the placeholders, as in the paper; plans never
    include placeholder segments (arguments take their positions). Without it, slots are skipped.
    """
    leaves: list[_Leaf | None] = []  # None marks a skipped parameter slot, which ends a segment
    ancestry: dict[str, tuple[str, ...]] = {}
    _flatten(root, root, (), leaves, ancestry, placeholder_id)

    groups: list[list[_Leaf]] = []
    for leaf in leaves:
        previous = groups[-1][-1] if groups and groups[-1] else None
        if leaf is None:
            groups.append([])
        elif leaf.is_placeholder:
            groups.append([leaf])
            groups.append([])
        elif (previous is not None and previous.owner == leaf.owner and previous.run.end == leaf.run.start
              and not previous.is_placeholder
              and previous.run.role_suffix_of is None and leaf.run.role_suffix_of is None):
            groups[-1].append(leaf)
        else:
            groups.append([leaf])

    segments: list[Segment] = []
    for group in filter(None, groups):
        token_ids = tuple(t for leaf in group for t in leaf.run.token_ids)
        start, owner = group[0].run.start, group[0].owner
        guaranteed = set(ancestry[owner])
        context = tuple(s.segment_id for s in segments if s.owner in guaranteed and s.end <= start)
        segments.append(Segment(
            segment_id=len(segments), token_ids=token_ids, start=start, owner=owner, context_ids=context,
            is_cached=group[0].is_cached, role_suffix_of=group[0].run.role_suffix_of,
            is_placeholder=group[0].is_placeholder, is_continuation=group[0].run.is_continuation,
            digest=segment_digest(start, token_ids)))
    return tuple(segments)


def _flatten(node: Node, owner: Module, ancestors: tuple[str, ...], leaves: list[_Leaf | None],
             ancestry: dict[str, tuple[str, ...]], placeholder_id: int | None) -> None:
    if isinstance(node, TextRun):
        leaves.append(_Leaf(node, owner.path, owner.is_cached))
    elif isinstance(node, Param):
        if placeholder_id is None:
            leaves.append(None)
        else:
            run = TextRun((placeholder_id,) * node.length, node.start, node.line)
            leaves.append(_Leaf(run, owner.path, owner.is_cached, is_placeholder=True))
    elif isinstance(node, Module):
        chain = (*ancestors, node.path)
        ancestry[node.path] = chain
        for child in node.children:
            _flatten(child, node, chain, leaves, ancestry, placeholder_id)
    elif isinstance(node, Union):
        for member in node.members:
            _flatten(member, owner, ancestors, leaves, ancestry, placeholder_id)
    elif isinstance(node, RoleSection):
        for child in node.children:
            _flatten(child, owner, ancestors, leaves, ancestry, placeholder_id)


def ancestors_of(modules: Mapping[str, Module], path: str) -> tuple[str, ...]:
    """The paths of `path`'s enclosing modules, outermost first, including "" and `path` itself."""
    chain = [path]
    while (parent := modules[chain[-1]].parent_path) is not None:
        chain.append(parent)
    return tuple(reversed(chain))


def build_scaffolds(elements: Sequence[etree._Element], modules: Mapping[str, Module],
                    segments: tuple[Segment, ...]) -> tuple[Scaffold, ...]:
    """Validate `<scaffold modules="a b.c"/>` declarations and compute their joint contexts."""
    scaffolds: list[Scaffold] = []
    for element in elements:
        line = element.sourceline
        for attribute in element.attrib:
            if attribute not in ("modules", "name"):
                raise ScaffoldError(f"<scaffold> has unknown attribute {attribute!r}; expected: modules, name",
                                    line=line)
        paths = tuple((element.get("modules") or "").split())
        if len(paths) < 2:
            raise ScaffoldError("<scaffold modules=...> must name at least two module paths", line=line)
        if len(set(paths)) != len(paths):
            raise ScaffoldError(f"<scaffold> names a module twice: {' '.join(paths)}", line=line)
        for path in paths:
            if path not in modules or not path:
                raise ScaffoldError(f"<scaffold> names unknown module {path!r}; known modules are "
                                    f"{[p for p in modules if p]}", line=line)
            if not modules[path].is_cached:
                raise ScaffoldError(f"<scaffold> names module {path!r}, which has cache=\"false\"", line=line)
        group = {a for path in paths for a in ancestors_of(modules, path)}
        _check_no_overlap([s for s in segments if s.owner in group and s.owner], line)
        name = element.get("name") or "+".join(paths)
        if any(s.name == name for s in scaffolds):
            raise ScaffoldError(f"<scaffold> name {name!r} is declared twice", line=line)
        # Every segment of the group (scaffold modules, their ancestors, the root) gets its joint
        # context: root text between two scaffold modules is encoded after the first one too.
        contexts = {
            s.segment_id: tuple(c.segment_id for c in segments if c.owner in group and c.end <= s.start)
            for s in segments if s.owner in group
        }
        scaffolds.append(Scaffold(name, paths, MappingProxyType(contexts), line))
    return tuple(scaffolds)


def _check_no_overlap(members: list[Segment], line: int) -> None:
    ordered = sorted(members, key=lambda s: s.start)
    for before, after in pairwise(ordered):
        if after.start < before.end:
            raise ScaffoldError(
                f"<scaffold> modules {before.owner!r} and {after.owner!r} share positions "
                f"[{after.start}, {min(before.end, after.end)}) (members of one union cannot be scaffolded "
                "together)", line=line)

"""Cut a schema tree into cacheable segments and give each its encoding contexts (docs/pml.md).
A segment's default context is every segment guaranteed to precede it whenever it is included: the
always-included text and its enclosing modules' text before it, plus the content of the `scaffold` member of
each union before it in an enclosing module (recursively). Contexts are prefix-closed, so encoding a segment
after its context's KV equals a full prefill of context + segment. Their total length can grow with the
square of the number of segments: `ContextBudget` bounds it."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, pairwise
from types import MappingProxyType

from lxml import etree

from promptcache.pml.errors import PmlLimitError, ScaffoldError
from promptcache.pml.schema import Module, Node, Param, RoleSection, Scaffold, Segment, TextRun, Union, segment_digest
from promptcache.pml.xml_reader import check_attributes


@dataclass(frozen=True, slots=True)
class _Leaf:
    run: TextRun
    owner: str
    is_cached: bool
    is_placeholder: bool = False


class ContextBudget:
    """How many segment ids the contexts of one schema (default and scaffold) may list in all."""

    def __init__(self, max_context_ids: int) -> None:
        self.max_context_ids = max_context_ids
        self.num_context_ids = 0

    def spend(self, num_ids: int, line: int | None = None) -> None:
        """Count `num_ids` more; raises PmlLimitError past the budget."""
        self.num_context_ids += num_ids
        if self.num_context_ids > self.max_context_ids:
            raise PmlLimitError(f"the schema's encoding contexts list more than {self.max_context_ids} segments in "
                                "all (every text piece's context lists the always-included and enclosing text "
                                "before it); use fewer text pieces between modules or role sections", line=line)


class _PrefixIndex:
    """Segments by owner in position order, so "the owner's segments ending by p" is a prefix (bisection)."""

    def __init__(self) -> None:
        self._ends: dict[str, list[int]] = {}
        self._ids: dict[str, list[int]] = {}

    def add(self, segment: Segment) -> None:
        ends = self._ends.get(segment.owner)
        assert not ends or ends[-1] <= segment.start, "an owner's segments are laid out in order"
        self.add_at(segment.owner, segment.end, segment.segment_id)

    def add_at(self, owner: str, end: int, segment_id: int) -> None:
        """File `segment_id` under `owner` as ending at `end` (ends added per owner never decrease)."""
        self._ends.setdefault(owner, []).append(end)
        self._ids.setdefault(owner, []).append(segment_id)

    def ending_by(self, owners: Iterable[str], position: int) -> list[list[int]]:
        """For each owner, the ids of its segments that end at or before `position`."""
        return [self._ids[owner][:bisect.bisect_right(self._ends[owner], position)]
                for owner in owners if self._ends.get(owner)]


def _context(prefixes: list[list[int]], budget: ContextBudget, line: int | None) -> tuple[int, ...]:
    budget.spend(sum(map(len, prefixes)), line)
    return tuple(sorted(chain.from_iterable(prefixes)))  # ascending ids: the segments in layout order


def build_segments(root: Module, placeholder_id: int | None, budget: ContextBudget) -> tuple[Segment, ...]:
    """Merge adjacent text runs of one owner into segments; compute default contexts. With `placeholder_id`,
    every parameter slot becomes a placeholder segment (that token repeated, never in a plan) the text
    after it is encoded after, as in the paper; without, slots are skipped. PmlLimitError past `budget`."""
    leaves: list[_Leaf | None] = []  # None marks a skipped parameter slot, which ends a segment
    ancestry: dict[str, tuple[str, ...]] = {}
    scaffold_of: dict[str, tuple[tuple[str, int], ...]] = {}
    _flatten(root, root, (), leaves, ancestry, scaffold_of, placeholder_id)
    groups: list[list[_Leaf]] = []
    for leaf in leaves:
        previous = groups[-1][-1] if groups and groups[-1] else None
        if leaf is None:
            groups.append([])
        elif leaf.is_placeholder:
            groups += [[leaf], []]
        elif (previous is not None and previous.owner == leaf.owner and previous.run.end == leaf.run.start
              and not previous.is_placeholder
              and previous.run.role_suffix_of is None and leaf.run.role_suffix_of is None):
            groups[-1].append(leaf)
        else:
            groups.append([leaf])
    segments: list[Segment] = []
    index = _PrefixIndex()
    # Union scaffold content by the union's module, filed under the union's end (seen by segments after it).
    scaffolds = _PrefixIndex()
    for group in filter(None, groups):
        token_ids = tuple(chain.from_iterable(leaf.run.token_ids for leaf in group))
        start, owner, line = group[0].run.start, group[0].owner, group[0].run.line
        context = _context(index.ending_by(ancestry[owner], start) + scaffolds.ending_by(ancestry[owner], start),
                           budget, line)
        segment = Segment(
            segment_id=len(segments), token_ids=token_ids, start=start, owner=owner, context_ids=context,
            is_cached=group[0].is_cached, role_suffix_of=group[0].run.role_suffix_of,
            is_placeholder=group[0].is_placeholder, is_continuation=group[0].run.is_continuation,
            digest=segment_digest(start, token_ids))
        segments.append(segment)
        index.add(segment)
        for union_owner, union_end in scaffold_of[owner]:
            scaffolds.add_at(union_owner, union_end, segment.segment_id)
    return tuple(segments)


def _flatten(node: Node, owner: Module, ancestors: tuple[str, ...], leaves: list[_Leaf | None],
             ancestry: dict[str, tuple[str, ...]], scaffold_of: dict[str, tuple[tuple[str, int], ...]],
             placeholder_id: int | None) -> None:
    """Leaves in layout order. `ancestry[path]`: the module paths enclosing `path` (itself included);
    `scaffold_of[path]`: (module a union is in, the union's end) for each union whose scaffold content
    the module is, innermost first."""
    if isinstance(node, TextRun):
        leaves.append(_Leaf(node, owner.path, owner.is_cached))
    elif isinstance(node, Param):
        # The slot while its module is encoded: its scaffold text, then placeholders (none when skipped).
        filler = () if placeholder_id is None else (placeholder_id,) * (node.length - len(node.scaffold_ids))
        if node.scaffold_ids or filler:
            run = TextRun(node.scaffold_ids + filler, node.start, node.line)
            leaves.append(_Leaf(run, owner.path, owner.is_cached, is_placeholder=True))
        else:
            leaves.append(None)
    elif isinstance(node, Module):
        chain = (*ancestors, node.path)
        ancestry[node.path] = chain
        scaffold_of.setdefault(node.path, ())
        for child in node.children:
            _flatten(child, node, chain, leaves, ancestry, scaffold_of, placeholder_id)
    elif isinstance(node, Union):
        for member in node.members:
            if member.name == node.scaffold:
                scaffold_of[member.path] = ((owner.path, node.end), *scaffold_of[owner.path])
            _flatten(member, owner, ancestors, leaves, ancestry, scaffold_of, placeholder_id)
    elif isinstance(node, RoleSection):
        for child in node.children:
            _flatten(child, owner, ancestors, leaves, ancestry, scaffold_of, placeholder_id)


def ancestors_of(modules: Mapping[str, Module], path: str) -> tuple[str, ...]:
    """The paths of `path`'s enclosing modules, outermost first, including "" and `path` itself."""
    chain = [path]
    while (parent := modules[chain[-1]].parent_path) is not None:
        chain.append(parent)
    return tuple(reversed(chain))


def build_scaffolds(elements: Sequence[etree._Element], modules: Mapping[str, Module],
                    segments: tuple[Segment, ...], budget: ContextBudget) -> tuple[Scaffold, ...]:
    """Validate `<scaffold modules="a b.c"/>` declarations and compute their joint contexts. Raises
    ScaffoldError, or PmlLimitError when the contexts exceed `budget`."""
    owned: dict[str, list[Segment]] = {}
    for segment in segments:
        owned.setdefault(segment.owner, []).append(segment)
    scaffolds: list[Scaffold] = []
    names: set[str] = set()
    for element in elements:
        line = element.sourceline
        check_attributes(element, {"modules", "name"}, ScaffoldError)
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
        members = sorted((s for owner in group for s in owned.get(owner, ())), key=lambda s: s.start)
        for before, after in pairwise(s for s in members if s.owner):
            if after.start < before.end:
                raise ScaffoldError(
                    f"<scaffold> modules {before.owner!r} and {after.owner!r} share positions "
                    f"[{after.start}, {min(before.end, after.end)}) (members of one union cannot be scaffolded "
                    "together)", line=line)
        name = element.get("name") or "+".join(paths)
        if name in names:
            raise ScaffoldError(f"<scaffold> name {name!r} is declared twice", line=line)
        names.add(name)
        # Every segment of the group gets its joint context: the members ending by its start (a prefix of them).
        ends, ids = [s.end for s in members], [s.segment_id for s in members]
        contexts = {s.segment_id: _context([ids[:bisect.bisect_right(ends, s.start)]], budget, line)
                    for s in sorted(members, key=lambda s: s.segment_id)}
        scaffolds.append(Scaffold(name, paths, MappingProxyType(contexts), line))
    return tuple(scaffolds)

"""PML prompt text -> PromptPlan: imports resolved, new text placed at positions (docs/pml.md, "Positions").
Imports take their layout positions. Text before an import starts after the preceding import (or the used
positions below the next import) and must fit before any used position (else PositionConflictError); text
after the last import starts after the highest used position; the tail of a role element that imports a
schema section's modules goes after its last import, before the section's closing markup. New text or an
argument first after BOS is encoded as a sequence start (TextEncoder)."""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import replace

from promptcache.pml.errors import (
    ArgumentTooLongError,
    EmptyPromptError,
    PositionConflictError,
    PromptError,
    UnknownSchemaError,
)
from promptcache.pml.plan import CachedSegment, NewRun, PromptPlan, find_approximations
from promptcache.pml.prompt_reader import ImportItem, PromptItems, PromptReader, TextPiece
from promptcache.pml.schema import Scaffold, Schema, Segment
from promptcache.pml.text_encoder import TextEncoder
from promptcache.pml.xml_reader import XML_SPACE, PmlLimits, check_attributes, parse_xml

GENERATION_PROMPT = "generation_prompt"  # the `source` of the run that opens the assistant turn


def parse_prompt(text: str, schemas: Mapping[str, Schema], encoder: TextEncoder, limits: PmlLimits | None = None, *,
                 isolated: bool = False, add_generation_prompt: bool = False) -> PromptPlan:
    """Resolve a `<prompt schema="...">` document against `schemas` (by name; parsed with `encoder`).
    `isolated=True`: the paper's literal masking (each module encoded seeing only itself) instead of
    guaranteed-context encoding. `add_generation_prompt=True` opens the assistant turn after the prompt, as
    a chat template does, unless it ends in an open `<assistant>` turn (`generation_prompt_added` says).
    Raises a PmlError subclass for invalid prompts."""
    limits = limits or PmlLimits()
    root = parse_xml(text, limits, max_bytes=limits.max_prompt_bytes, what="prompt")
    if root.tag != "prompt":
        raise PromptError(f"the root element is <{root.tag}>; expected <prompt schema=...>", line=root.sourceline)
    check_attributes(root, {"schema", XML_SPACE}, PromptError)
    name = root.get("schema")
    if name is None:
        raise PromptError("<prompt> needs a schema attribute", line=root.sourceline)
    schema = schemas.get(name)
    if schema is None:
        raise UnknownSchemaError(f"<prompt> names unknown schema {name!r} (loaded: {sorted(schemas)})",
                                 line=root.sourceline, schema_name=name)
    items = PromptReader(schema, encoder).read(root, add_generation_prompt=add_generation_prompt)
    plan, first = _build_plan(schema, items, encoder, isolated=isolated)
    if isinstance(first, NewRun) and first.kind == "argument":
        # The argument starts the sequence: encode it so and place again (only its length can change).
        length, value = items.argument_values[first.source]
        token_ids = encoder.encode(value, at_start=True)
        if token_ids != first.token_ids:
            if len(token_ids) > length:
                raise ArgumentTooLongError(
                    f"argument {first.source!r} starts the prompt, where it is {len(token_ids)} tokens; the "
                    f"limit is {length} tokens (<param len>)", line=first.line)
            for item in [*items.items, items.implicit]:
                if isinstance(item, ImportItem):
                    item.arguments = [replace(r, token_ids=token_ids) if r is first else r for r in item.arguments]
            plan, _ = _build_plan(schema, items, encoder, isolated=isolated)
    return plan


def _build_plan(schema: Schema, items: PromptItems, encoder: TextEncoder, *,
                isolated: bool) -> tuple[PromptPlan, Segment | NewRun | None]:
    """The plan, and the segment or run that comes first after BOS in it (None: nothing does)."""
    first_position = len(encoder.bos_token_ids)
    imported = set(items.imported)
    included = [s for s in schema.segments if (s.owner == "" or s.owner in imported) and not s.is_placeholder
                and s.role_suffix_of not in items.displaced_sections]
    new_runs = [NewRun(s.token_ids, s.start, "module", s.owner, 0) for s in included if not s.is_cached]
    for item in [*items.items, items.implicit]:
        if isinstance(item, ImportItem):
            new_runs.extend(item.arguments)
    used = Occupancy()
    occupied: list[Segment | NewRun] = [*included, *(run for run in new_runs if run.kind == "argument")]
    for taken in occupied:
        used.add(taken.start, taken.end)
    # Looked up per import and per segment: indexed once, so a prompt importing many modules stays linear.
    owned: dict[str, list[Segment]] = {}
    for segment in schema.segments:
        owned.setdefault(segment.owner, []).append(segment)
    new_runs.extend(_place_text(schema, items, included, used, encoder, first_position, owned))
    scaffolds = _best_scaffolds(schema, imported)
    cached = tuple(_cached_segment(s, owned, scaffolds, isolated) for s in included if s.is_cached)
    runs = tuple(sorted(new_runs, key=lambda r: r.start))
    if not cached and not any(run.token_ids for run in runs if run.source != GENERATION_PROMPT):
        raise EmptyPromptError("the prompt includes no tokens: import a module or add text")
    positions = [p for c in cached for p in c.segment.position_ids] + [p for r in runs for p in range(r.start, r.end)]
    assert len(positions) == len(set(positions)), "two tokens of a plan share a position"
    module_paths = tuple(sorted(imported, key=lambda p: (schema.modules[p].start, p)))
    # Module runs are in `included` as their segments; BOS (with any text merged into its segment) is not.
    items_after_bos: list[Segment | NewRun] = [s for s in included if s.end > first_position]
    items_after_bos += [r for r in runs if r.kind != "module" and r.token_ids]
    first = min(items_after_bos, key=lambda x: x.start, default=None)

    def absent_owner(segment_id: int) -> str | None:  # a default context's module not imported: a union scaffold
        owner = schema.segments[segment_id].owner
        return owner if owner and owner not in imported else None

    plan = PromptPlan(schema, tuple(sorted(cached, key=lambda c: c.segment.start)), runs, module_paths,
                      find_approximations(cached, runs, absent_owner) + _start_notes(first),
                      generation_prompt_added=items.generation_prompt_added)
    return plan, first


def _start_notes(first: Segment | NewRun | None) -> tuple[str, ...]:
    if not isinstance(first, Segment) or not first.is_continuation:
        return ()
    owner = f"module {first.owner!r}" if first.owner else "the schema's always-included text"
    return (f"{owner} starts this prompt (position {first.start}) but was tokenized as continuing the schema "
            "text laid out before it; the tokenizer starts a sequence differently (SentencePiece's '▁'), so "
            "these token ids differ from the tokenization of the prompt's text",)


def _best_scaffolds(schema: Schema, imported: set[str]) -> dict[int, Scaffold]:
    """Segment id -> its scaffold: of those with all modules imported, the one with most (first on a tie)."""
    best: dict[int, Scaffold] = {}
    for scaffold in schema.scaffolds:
        if not imported.issuperset(scaffold.module_paths):
            continue
        for segment_id in scaffold.contexts:
            current = best.get(segment_id)
            if current is None or len(scaffold.module_paths) > len(current.module_paths):
                best[segment_id] = scaffold
    return best


def _cached_segment(segment: Segment, owned: dict[str, list[Segment]], scaffolds: dict[int, Scaffold],
                    isolated: bool) -> CachedSegment:
    if isolated:
        own = tuple(s.segment_id for s in owned[segment.owner] if s.end <= segment.start)
        return CachedSegment(segment, own, "isolated")
    best = scaffolds.get(segment.segment_id)
    if best is not None and best.contexts[segment.segment_id] != segment.context_ids:
        return CachedSegment(segment, best.contexts[segment.segment_id], f"scaffold:{best.name}")
    return CachedSegment(segment, segment.context_ids, "default")


def _place_text(schema: Schema, items: PromptItems, included: list[Segment], used: Occupancy,
                encoder: TextEncoder, first_position: int, owned: dict[str, list[Segment]]) -> list[NewRun]:
    spans = {id(item): _span(schema, item, owned) for item in items.items if isinstance(item, ImportItem)}
    # The span of the first import after each item (None after the last), in one backward pass.
    next_span: list[tuple[int, int] | None] = [None] * len(items.items)
    upcoming = None
    for index in range(len(items.items) - 1, -1, -1):
        next_span[index] = upcoming
        if isinstance(items.items[index], ImportItem):
            upcoming = spans[id(items.items[index])]
    runs: list[NewRun] = []
    cursor: int | None = None  # end of the previous placed element in document order
    for index, item in enumerate(items.items):
        if isinstance(item, ImportItem):
            cursor = spans[id(item)][1]
            continue
        if not item.token_ids:
            continue
        later = next_span[index]
        if item.after_section is not None:
            # After the highest-positioned content of the section's turn, where the displaced closing markup was.
            start = used.end_below(schema.role_sections[item.after_section].end)
        elif later is not None and cursor is not None:
            start = cursor
        else:
            start = used.end_below(later[0] if later is not None else None)
        if start == first_position and item.after_section is None:
            item = replace(item, token_ids=encoder.encode(item.text, at_start=True))  # it starts the sequence
        _check_free(item, start, used, included)
        run = NewRun(item.token_ids, start, item.kind, GENERATION_PROMPT if item.is_generation_prompt else "text",
                     item.line)
        runs.append(run)
        used.add(run.start, run.end)
        cursor = run.end
    return runs


def _span(schema: Schema, item: ImportItem, owned: dict[str, list[Segment]]) -> tuple[int, int]:
    """First and one-past-last position of the tokens an import includes."""
    ranges = [(s.start, s.end) for path in item.module_paths for s in owned.get(path, ()) if not s.is_placeholder]
    ranges += [(run.start, run.end) for run in item.arguments if run.end > run.start]
    if not ranges:
        start = min(schema.modules[p].start for p in item.module_paths)
        return start, start
    return min(start for start, _ in ranges), max(end for _, end in ranges)


def _check_free(piece: TextPiece, start: int, used: Occupancy, included: list[Segment]) -> None:
    end = start + len(piece.token_ids)
    clash = used.first_in(start, end)
    if clash is None:
        return
    owner = next((s.owner for s in included if clash in s.position_ids), None)
    what = f"module {owner!r}" if owner else ("the schema's always-included text" if owner == "" else
                                              "an argument or earlier text")
    raise PositionConflictError(
        f"new text {piece.snippet!r} is {len(piece.token_ids)} tokens but only {clash - start} positions are "
        f"free at [{start}, {clash}) before {what} at position {clash}; add a <param> buffer to the schema "
        "there, or move the text after the last import", line=piece.line)


class Occupancy:
    """Used positions as sorted, disjoint, non-adjacent half-open intervals [start, end): both queries
    placement makes per text piece are logarithmic (with a set of positions, placement was quadratic)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        """Mark [start, end) used (it may touch or overlap used intervals)."""
        if start >= end:
            return
        i = bisect.bisect_left(self._ends, start)  # first interval that ends at or after start
        j = bisect.bisect_right(self._starts, end)  # intervals [i, j) touch or overlap [start, end)
        if i < j:
            start, end = min(start, self._starts[i]), max(end, self._ends[j - 1])
        self._starts[i:j] = [start]
        self._ends[i:j] = [end]

    def end_below(self, limit: int | None) -> int:
        """One past the highest used position < limit (None: any position), or 0 when there is none."""
        if limit is None:
            return self._ends[-1] if self._ends else 0
        i = bisect.bisect_left(self._starts, limit) - 1  # last interval starting below limit
        return 0 if i < 0 else min(self._ends[i], limit)

    def first_in(self, start: int, end: int) -> int | None:
        """The lowest used position in [start, end), or None."""
        i = bisect.bisect_right(self._ends, start)  # first interval ending after start
        return None if i == len(self._starts) or self._starts[i] >= end else max(self._starts[i], start)

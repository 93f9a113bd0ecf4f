"""Property test: random valid schemas and prompts give plans with one token per position."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptcache.pml import PositionConflictError, TextEncoder, parse_prompt, parse_schema
from tests.model_factories import make_test_tokenizer

WORDS = ["cat", "dog", "the", "blue", "sky", "runs", "fast", "and", "over", "42", "é", "<&>"]
ENCODER = TextEncoder.from_tokenizer(make_test_tokenizer())


@dataclass
class ModuleSpec:
    name: str
    params: dict[str, int] = field(default_factory=dict)
    children: list[ModuleSpec] = field(default_factory=list)
    unions: list[list[ModuleSpec]] = field(default_factory=list)


def _text(draw) -> str:
    words = draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=6))
    return " ".join(words).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


@st.composite
def schemas_and_prompts(draw):
    ids = itertools.count()

    def body(spec: ModuleSpec, depth: int, allow_params: bool) -> str:
        parts = []
        for _ in range(draw(st.integers(0, 4))):
            kinds = ["text", "module", "union"] if depth < 3 else ["text"]
            kind = draw(st.sampled_from(kinds + (["param"] if allow_params else [])))
            if kind == "text":
                parts.append(_text(draw))
            elif kind == "param":
                name = f"p{next(ids)}"
                spec.params[name] = draw(st.integers(1, 6))
                parts.append(f'<param name="{name}" len="{spec.params[name]}"/>')
            elif kind == "module":
                child = ModuleSpec(f"m{next(ids)}")
                spec.children.append(child)
                parts.append(f'<module name="{child.name}">{body(child, depth + 1, True)}</module>')
            else:
                members = [ModuleSpec(f"m{next(ids)}") for _ in range(draw(st.integers(1, 3)))]
                spec.unions.append(members)
                inner = "".join(f'<module name="{m.name}">{body(m, depth + 1, True)}</module>' for m in members)
                parts.append(f"<union>{inner}</union>")
        return "".join(parts)

    root = ModuleSpec("root")
    schema_xml = f'<schema name="r">{body(root, 0, False)}</schema>'

    def imports(spec: ModuleSpec) -> list[str]:
        chosen = [c for c in spec.children if draw(st.booleans())]
        for members in spec.unions:
            pick = draw(st.integers(-1, len(members) - 1))
            if pick >= 0:
                chosen.append(members[pick])
        chosen = draw(st.permutations(chosen))
        out = []
        for child in chosen:
            args = ""
            for name, limit in child.params.items():
                value = draw(st.sampled_from(["", "cat", "the sky", "dog runs fast", "42 and 42"]))
                if draw(st.booleans()) and len(ENCODER.encode(value)) <= limit:
                    args += f' {name}="{value}"'
            out.append(f"<{child.name}{args}>{''.join(imports(child))}</{child.name}>")
        return out

    parts = imports(root)
    pieces = []
    for part in parts:
        if draw(st.integers(0, 4)) == 0:
            pieces.append(_text(draw))
        pieces.append(part)
    if draw(st.booleans()):
        pieces.append(_text(draw))
    return schema_xml, f'<prompt schema="r">{"".join(pieces)}</prompt>'


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schemas_and_prompts())
def test_no_two_tokens_share_a_position(case):
    schema_xml, prompt_xml = case
    schema = parse_schema(schema_xml, ENCODER)
    try:
        plan = parse_prompt(prompt_xml, {"r": schema}, ENCODER)
    except PositionConflictError:
        return  # text that does not fit between imports is a legitimate, named rejection
    except Exception as exc:
        if "no tokens" in str(exc):
            return
        raise
    positions = plan.position_ids()
    assert len(positions) == len(set(positions))
    for cached in plan.cached:
        assert cached.segment.start >= 0 and cached.segment.end <= schema.num_positions
        assert set(cached.context_ids) <= {s.segment_id for s in schema.segments if s.end <= cached.segment.start}
    for run in plan.new_runs:
        assert run.start >= 0
        if run.kind == "argument":
            module_path, name = run.source.rsplit(".", 1)
            param = schema.modules[module_path].params[name]
            assert param.start <= run.start and run.end <= param.end
    # Every imported module's own segments are in the plan, and nothing else optional is.
    owners = {c.segment.owner for c in plan.cached}
    assert owners <= {"", *plan.module_paths}

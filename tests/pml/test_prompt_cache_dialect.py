"""The Prompt Cache reference implementation's PML dialect (yale-sys/prompt-cache): its constructs parse
with their meaning. Schemas here are written in that dialect (comments, `<parameter length scaffold>`,
`<union scaffold>`, `cache="false"`, role tags inside modules, imports at the prompt's top level).
The model-level oracles (cached prefill equals a full prefill) are in test_prompt_cache_oracles.py."""

from __future__ import annotations

import time

import pytest

from promptcache.pml import (
    InvalidParamError,
    PmlError,
    PmlLimits,
    PmlSyntaxError,
    Schema,
    SchemaError,
    TextEncoder,
    parse_schema,
)

LAB = """<!-- A schema as the reference's README lays one out -->
<schema name="lab">

    <!-- Module names are unique in their scope -->
    <module name="preface">

        <!-- a parameter: its length, and a scaffold standing in its slot while modules are encoded -->
        Notes of <parameter name="who" length="8" scaffold="someone"/>

        <module name="nested">Nested</module>

        <system>
            <union scaffold="arm">
                <module name="arm">The robot is an arm.</module>
                <module name="rover" cache="false">The robot is a rover.</module>
                <module name="drone">The robot flies with
                    <parameter name="rotors" length="3"/> rotors.
                </module>
            </union>

            <union>
                <module name="indoor" cache="false">It works indoors.</module>
                <module name="outdoor">It works outdoors.</module>
            </union>
        </system>
    </module>

    <module name="task">
        <union>
            <module name="task-move">Move at <parameter name="speed" length="5"/></module>
            <module name="task-report">Report the status.</module>
        </union>
    </module>

</schema>
"""


def _segment(schema, owner: str, index: int = 0):
    return [s for s in schema.segments_of(owner) if not s.is_placeholder][index]


def test_reference_layout_unions_parameters_nested_modules(pml):
    schema = pml.schema(LAB)
    m = schema.modules
    members = [m["preface.arm"], m["preface.rover"], m["preface.drone"]]
    assert len({x.start for x in members}) == 1  # a union's members share their start
    union = m["preface"].unions[0]
    assert union.scaffold == "arm" and union.end == max(x.end for x in members)
    assert m["preface.indoor"].start == union.end  # the next union starts after the longest member
    assert m["preface"].params["who"].length == 8 and m["preface.drone"].params["rotors"].length == 3
    assert not m["preface.rover"].is_cached and m["preface.arm"].is_cached
    assert schema.modules["task"].start == m["preface"].end


def test_parameter_scaffold_stands_in_the_slot(pml, encoder):
    schema = pml.schema(LAB)
    slot = next(s for s in schema.segments_of("preface") if s.is_placeholder)
    scaffold = encoder.encode("someone")
    assert slot.token_ids == scaffold + (encoder.placeholder_id,) * (8 - len(scaffold))
    after = _segment(schema, "preface", 1)  # the text after the slot was encoded after the scaffold
    assert slot.segment_id in after.context_ids
    # Without a scaffold the slot holds placeholders; with params="skip", only the scaffold.
    rotors = next(s for s in schema.segments_of("preface.drone") if s.is_placeholder)
    assert rotors.token_ids == (encoder.placeholder_id,) * 3
    skipped = pml.schema(LAB.replace('<schema name="lab">', '<schema name="lab" params="skip">'))
    assert [s.token_ids for s in skipped.segments_of("preface") if s.is_placeholder] == [scaffold]


def test_parameter_scaffold_longer_than_its_slot_keeps_its_first_tokens(pml, encoder):
    long_text = "a placeholder much longer than the slot"
    schema = pml.schema(f'<schema name="s"><module name="m">A <parameter name="p" length="3" scaffold="{long_text}"/>'
                        " B</module></schema>")
    slot = next(s for s in schema.segments_of("m") if s.is_placeholder)
    assert slot.token_ids == encoder.encode(long_text)[:3] and slot.end == schema.modules["m"].params["p"].end


def test_union_scaffold_changes_exactly_the_encodings_the_rule_says(pml):
    with_scaffold = pml.schema(LAB)
    without = pml.schema(LAB.replace(' scaffold="arm"', ""))
    assert [s.token_ids for s in with_scaffold.segments] == [s.token_ids for s in without.segments]
    arm = {s.segment_id for s in with_scaffold.segments_of("preface.arm")}
    union_end = with_scaffold.modules["preface"].unions[0].end
    changed = set()
    for a, b in zip(with_scaffold.segments, without.segments):
        if a.context_ids != b.context_ids:
            changed.add(a.owner)
            assert set(a.context_ids) - set(b.context_ids) == arm and set(b.context_ids) <= set(a.context_ids)
            assert a.start >= union_end
    # What follows the union inside its module: the module's own text (the role suffix) and the second
    # union's members. Not the union's other members, not `task` (it does not include `preface`).
    assert changed == {"preface", "preface.indoor", "preface.outdoor"}


def test_nested_union_scaffold_is_part_of_its_members_content(pml):
    schema = pml.schema("""<schema name="s">Head
      <module name="outer">
        <union scaffold="a">
          <module name="a">A text <union scaffold="a1"><module name="a1">A one.</module><module name="a2">A two.</module>
          </union> a tail</module>
          <module name="b">B text</module>
        </union>
        After the union.
      </module>
    </schema>""")  # noqa: E501  (a module's text is whitespace-exact: its line stays whole)
    after = _segment(schema, "outer")
    content = {s.segment_id for p in ("outer.a", "outer.a.a1") for s in schema.segments_of(p)}
    assert content <= set(after.context_ids)
    assert not {s.segment_id for s in schema.segments_of("outer.a.a2")} & set(after.context_ids)
    a_tail = _segment(schema, "outer.a", 1)  # inside the member: its nested union's scaffold came before
    assert {s.segment_id for s in schema.segments_of("outer.a.a1")} <= set(a_tail.context_ids)


def test_union_scaffold_must_name_a_member(pml):
    with pytest.raises(SchemaError, match=r"<union scaffold='nope'> names no member"):
        pml.schema('<schema name="s"><union scaffold="nope"><module name="a">A</module></union></schema>')
    with pytest.raises(InvalidParamError, match="unknown attribute 'colour'"):
        pml.schema('<schema name="s"><module name="m"><parameter name="p" length="2" colour="red"/></module></schema>')


MBTI = """<schema name="mbti">
    <system>You are a helpful assistant.</system>
    <user>
        Create a character.
        <union scaffold="EI">
            <module name="EI"> </module>
            <module name="E">E (energized by people)</module>
            <module name="I">I (energized by solitude)</module>
        </union>
        Ready?
    </user>
</schema>
"""


def test_importing_the_union_scaffold_is_exact_and_another_member_says_why_not(pml):
    pml.schema(MBTI)
    assert pml.prompt('<prompt schema="mbti"><EI/><user>Who are you?</user></prompt>').is_exact
    plan = pml.prompt('<prompt schema="mbti"><E/><user>Who are you?</user></prompt>')
    assert not plan.is_exact
    assert any("union scaffold member(s) 'EI'" in reason and "does not import" in reason
               for reason in plan.approximations), plan.approximations
    pml.schema(MBTI.replace(' scaffold="EI"', ""))  # without it, importing EI leaves the text after inexact
    assert not pml.prompt('<prompt schema="mbti"><EI/><user>Who are you?</user></prompt>').is_exact


def test_cache_false_module_is_computed_per_request(pml, encoder):
    schema = pml.schema(LAB)
    plan = pml.prompt('<prompt schema="lab"><preface><rover/></preface></prompt>')
    runs = [r for r in plan.new_runs if r.kind == "module"]
    assert [r.source for r in runs] == ["preface.rover"]
    assert runs[0].token_ids == _segment(schema, "preface.rover").token_ids
    assert all(c.segment.owner != "preface.rover" for c in plan.cached)


def test_reference_prompt_shapes(pml, encoder):
    """Nested imports with arguments, role tags inside a module reached through the module, turns after."""
    pml.schema(LAB)
    plan = pml.prompt("""<prompt schema="lab">
        <preface who="Ada">
            <!-- only a subset of modules -->
            <nested/>
            <drone rotors="4"/>
            <outdoor/>
        </preface>
        <task><task-move speed="fast"/></task>
        <user>What next?</user>
        <assistant>Move forward.</assistant>
        <user>At what speed?</user>
    </prompt>""", add_generation_prompt=True)
    assert plan.module_paths == ("preface", "preface.nested", "preface.drone", "preface.outdoor", "task",
                                 "task.task-move")
    args = {r.source: r.token_ids for r in plan.new_runs if r.kind == "argument"}
    assert args == {"preface.who": encoder.encode("Ada"), "preface.drone.rotors": encoder.encode("4"),
                    "task.task-move.speed": encoder.encode("fast")}
    tail = encoder.encode("<|im_start|>user\nAt what speed?<|im_end|>\n") + encoder.encode("<|im_start|>assistant\n")
    assert tuple(plan.token_ids()[-len(tail):]) == tail and plan.generation_prompt_added


def test_comments_and_the_reference_layout_of_code(pml, encoder):
    """Code laid out from the margin keeps its indentation and its bare `<`; comments are dropped."""
    schema = pml.schema("""<schema name="code">
    <user>
        Read the file.
    <module name="grid.py">
class Grid:
    def inside(self, p):
        <!-- a comment inside code -->
        return 0 <= p[0] < self.size and a&b
    </module>
    </user>
</schema>""")
    text = "class Grid:\n    def inside(self, p):\n        \n        return 0 <= p[0] < self.size and a&b"
    assert _segment(schema, "grid.py").token_ids == encoder.encode(text)


def test_bare_less_than_that_begins_a_tag_is_a_400_naming_line_character_and_fix(pml):
    with pytest.raises(PmlSyntaxError, match=r"line 3: .*'<' at column 10.*'&lt;'.*CDATA"):
        pml.schema('<schema name="s">\n<module name="m">\n    if a <b: pass\n</module></schema>')


@pytest.mark.parametrize("line", ["        return 0 <= p[0] < self.size and a&b\n", "<<<< &&&& < & <=\n",
                                  "if a<b:\n"], ids=["code", "runs", "tag-like"])
def test_two_mib_of_bare_markup_parses_or_fails_in_under_a_second(line):
    """The escaping pass runs only after the strict parse fails, and is linear: two regex passes whose
    lookaheads stop within one name, and CDATA found with bytes.find."""
    # One token per word, and no cap on a text piece's length (this 1 MiB piece is over the default cap).
    words = TextEncoder(encode_fn=lambda text: [len(word) for word in text.split()], max_piece_chars=4 << 20)
    body = line * ((1 << 20) // len(line))  # twice in the document: 2 MiB
    doc = f'<schema name="big"><module name="m">\n{body}</module><![CDATA[ {body} ]]></schema>'
    limits = PmlLimits(max_schema_bytes=4 << 20, max_schema_tokens=4_000_000)
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        try:
            result = parse_schema(doc, words, limits)
        except PmlError as exc:
            result = exc
        seconds.append(time.perf_counter() - started)
    assert min(seconds) < 1
    assert isinstance(result, PmlSyntaxError if line.startswith("if a<b") else Schema)

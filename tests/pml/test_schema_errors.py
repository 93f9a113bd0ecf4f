"""Invalid schemas: every error has its class, names the element, and says what was expected."""

from __future__ import annotations

import pytest

from promptcache.pml import (
    InvalidNameError,
    InvalidParamError,
    PmlLimitError,
    PmlLimits,
    PmlSyntaxError,
    ScaffoldError,
    SchemaError,
)


@pytest.mark.parametrize("decl", [
    '<param name="p"/>',                      # no length
    '<param name="p" len="0"/>',
    '<param name="p" len="-3"/>',
    '<param name="p" len="ten"/>',
    '<param len="3"/>',                        # no name
    '<param name="p" length="3"/>',           # wrong attribute for this spelling
    '<parameter name="p" len="3"/>',
    '<param name="p" len="3">text</param>',
    '<param name="p" len="999999"/>',
])
def test_invalid_param_declarations(pml, decl):
    with pytest.raises((InvalidParamError, InvalidNameError)):
        pml.schema(f'<schema name="s"><module name="m">x {decl}</module></schema>')


def test_param_outside_a_module(pml):
    with pytest.raises(InvalidParamError, match="must be inside a <module>"):
        pml.schema('<schema name="s"><param name="p" len="3"/></schema>')


@pytest.mark.parametrize("name", ["1abc", "a b", "", "a/b", "ü"])
def test_name_syntax(pml, name):
    with pytest.raises(InvalidNameError, match="is invalid"):
        pml.schema(f'<schema name="s"><module name="{name}">x</module></schema>')


@pytest.mark.parametrize("name", ["user", "module", "union", "prompt", "param", "scaffold"])
def test_reserved_names(pml, name):
    with pytest.raises(InvalidNameError, match="reserved"):
        pml.schema(f'<schema name="s"><module name="{name}">x</module></schema>')


def test_scoping(pml):
    schema = pml.schema("""<schema name="s"><module name="a"><module name="x">1</module></module>
      <module name="b"><module name="x">2</module></module></schema>""")
    assert {"a.x", "b.x"} <= set(schema.modules)
    with pytest.raises(InvalidNameError, match="already declared"):
        pml.schema('<schema name="s2"><module name="a">1</module><module name="a">2</module></schema>')
    with pytest.raises(InvalidNameError, match="already declared"):
        pml.schema('<schema name="s3"><union><module name="a">1</module><module name="a">2</module></union></schema>')
    with pytest.raises(InvalidNameError, match="already declared"):  # union members share the parent scope
        pml.schema('<schema name="s4"><module name="a">1</module><union><module name="a">2</module></union></schema>')
    with pytest.raises(InvalidNameError, match="already declared"):
        pml.schema('<schema name="s5"><module name="m"><param name="p" len="2"/><module name="p">x</module></module>'
                   '</schema>')


def test_structural_errors(pml):
    with pytest.raises(SchemaError, match="expected <schema"):
        pml.schema('<prompt schema="x"/>')
    with pytest.raises(SchemaError, match="unknown element <foo>"):
        pml.schema('<schema name="s"><foo/></schema>')
    with pytest.raises(SchemaError, match="holds only <module>s"):
        pml.schema('<schema name="s"><union>text<module name="a">1</module></union></schema>')
    with pytest.raises(SchemaError, match="names no member"):
        pml.schema('<schema name="s"><union default="z"><module name="a">1</module></union></schema>')
    with pytest.raises(SchemaError, match="cannot be nested"):
        pml.schema('<schema name="s"><user><system>x</system></user></schema>')
    with pytest.raises(SchemaError, match="unknown attribute 'colour'"):
        pml.schema('<schema name="s"><module name="a" colour="red">1</module></schema>')
    with pytest.raises(SchemaError, match="line 3"):
        pml.schema('<schema name="s">\n<module name="a">1</module>\n<bogus/></schema>')


def test_bare_less_than_and_ampersand_are_text(pml):
    schema = pml.schema('<schema name="s"><module name="m">if a < b &amp;&amp; c<=d & Q&A: &lt;</module></schema>')
    assert schema.segments_of("m")[0].token_ids == pml.encoder.encode("if a < b && c<=d & Q&A: <")
    plan = pml.prompt('<prompt schema="s"><m/>a < b & c</prompt>')
    assert plan.new_token_ids() == list(pml.encoder.encode("a < b & c"))


def test_less_than_that_looks_like_a_tag_names_line_character_and_fix(pml):
    with pytest.raises(PmlSyntaxError, match=r"line 2: .*the '<' at column 6: '<b: pass.*&lt;.*CDATA"):
        pml.schema('<schema name="s"><module name="m">\nif a <b: pass</module></schema>')
    pml.schema('<schema name="ok"><module name="m">x</module></schema>')
    with pytest.raises(PmlSyntaxError, match=r"the '&' at column 23: '&nbsp;"):
        pml.prompt('<prompt schema="ok">a &nbsp; b</prompt>')


def test_scaffold_validation(pml):
    base = """<schema name="s"><module name="a">1</module><module name="b">2</module>
      <union><module name="x">3</module><module name="y">4</module></union>{}</schema>"""
    with pytest.raises(ScaffoldError, match="unknown module 'zz'"):
        pml.schema(base.format('<scaffold modules="a zz"/>'))
    with pytest.raises(ScaffoldError, match="share positions"):
        pml.schema(base.format('<scaffold modules="x y"/>'))
    with pytest.raises(ScaffoldError, match="at least two"):
        pml.schema(base.format('<scaffold modules="a"/>'))
    with pytest.raises(SchemaError, match="direct child"):
        pml.schema('<schema name="s"><module name="a"><scaffold modules="a b"/></module></schema>')
    assert pml.schema(base.format('<scaffold modules="a b x"/>')).scaffolds[0].module_paths == ("a", "b", "x")


def test_size_limits(pml):
    with pytest.raises(PmlLimitError, match="bytes"):
        pml.schema('<schema name="s">' + "x" * 200 + "</schema>", PmlLimits(max_schema_bytes=100))
    deep = ('<schema name="s">' + "".join(f'<module name="m{i}">' for i in range(10)) + "x" + "</module>" * 10
            + "</schema>")
    with pytest.raises(PmlLimitError, match="nests deeper"):
        pml.schema(deep, PmlLimits(max_depth=5))
    many = '<schema name="s">' + "".join(f'<module name="m{i}">x</module>' for i in range(20)) + "</schema>"
    with pytest.raises(PmlLimitError, match="more than 10 modules"):
        pml.schema(many, PmlLimits(max_modules=10))

"""PML builder and @prompt programs: exact XML out, escaping, and the server's parser accepts it."""

from __future__ import annotations

import pytest

from promptcache.clients import (
    AssistantTurn,
    Import,
    Module,
    Param,
    Prompt,
    Scaffold,
    Schema,
    System,
    Union,
    User,
    prompt,
)
from promptcache.pml import TextEncoder, parse_prompt, parse_schema
from tests.model_factories import make_test_tokenizer


def test_builder_output_and_escaping():
    schema = Schema("trip", [
        System("You plan trips & <fun>."),
        User([Module("trip-plan", ["Plan a trip of ", Param("duration", 4), " days."]),
              Union([Module("miami", "Beaches."), Module("paris", "Museums.")], default="miami")]),
        Scaffold(["trip-plan", "miami"]),
    ])
    assert schema.to_pml() == (
        '<schema name="trip"><system>You plan trips &amp; &lt;fun&gt;.</system><user><module name="trip-plan">'
        'Plan a trip of <param name="duration" len="4"/> days.</module><union default="miami"><module name="miami">'
        'Beaches.</module><module name="paris">Museums.</module></union></user>'
        '<scaffold modules="trip-plan miami"/></schema>')
    request = Prompt("trip", [User([Import("trip-plan", duration='3 "long"'), Import("paris"), "Food & wine?"]),
                              AssistantTurn()])
    assert request.to_pml() == ('<prompt schema="trip"><user><trip-plan duration=\'3 "long"\'/><paris/>'
                                "Food &amp; wine?</user><assistant/></prompt>")
    encoder = TextEncoder.from_tokenizer(make_test_tokenizer())
    parsed = parse_schema(schema.to_pml(), encoder)
    plan = parse_prompt(Prompt("trip", [User([Import("trip-plan", duration="3"), Import("paris"), "Q?"]),
                                        AssistantTurn()]).to_pml(), {"trip": parsed}, encoder)
    assert plan.module_paths == ("trip-plan", "paris")


@pytest.mark.parametrize("bad", ["1x", "a b", "user", ""])
def test_builder_rejects_bad_names(bad):
    with pytest.raises(ValueError):
        Module(bad, "x")


@prompt("trip", duration="", destination="miami", surf=False)
def trip(p, duration, destination, surf):
    with p.system():
        p.text("You are a travel agent.")
    with p.user():
        with p.module("plan"):
            p.text("Plan a trip of ")
            p.param("duration", max_len=4, value=duration)
            p.text(" days.")
        with p.union(default="miami"):
            with p.case("miami", when=destination == "miami"):
                p.text("Miami.")
            with p.case("paris", when=destination == "paris"):
                p.text("Paris.")
        with p.module("surf", when=surf):
            p.text("Include surf spots.")
        p.ask("Highlight the food.")


def test_prompt_program_compiles_to_schema_and_prompts():
    assert trip.schema_pml() == (
        '<schema name="trip"><system>You are a travel agent.</system><user><module name="plan">Plan a trip of '
        '<param name="duration" len="4"/> days.</module><union default="miami"><module name="miami">Miami.</module>'
        '<module name="paris">Paris.</module></union><module name="surf">Include surf spots.</module></user></schema>')
    assert trip(duration="3", destination="paris") == (
        '<prompt schema="trip"><user><plan duration="3"/><paris/>Highlight the food.</user><assistant/></prompt>')
    assert trip.prompt_pml(duration="5", surf=True) == (
        '<prompt schema="trip"><user><plan duration="5"/><miami/><surf/>Highlight the food.</user>'
        "<assistant/></prompt>")
    encoder = TextEncoder.from_tokenizer(make_test_tokenizer())
    schema = parse_schema(trip.schema_pml(), encoder)
    plan = parse_prompt(trip(duration="3", destination="paris"), {"trip": schema}, encoder)
    assert plan.module_paths == ("plan", "paris")


@prompt("outer")
def outer(p):
    p.text("Intro.")
    p.call(inner_program, topic="cats")


@prompt("inner-program", topic="")
def inner_program(p, topic):
    p.text("About ")
    p.param("topic", max_len=3, value=topic)


def test_calls_become_nested_modules():
    assert outer.schema_pml() == ('<schema name="outer">Intro.<module name="inner-program">About '
                                  '<param name="topic" len="3"/></module></schema>')
    assert outer.prompt_pml(generate=False) == '<prompt schema="outer"><inner-program topic="cats"/></prompt>'

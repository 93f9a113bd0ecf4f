"""Seeded module combinations of a schema, written as PML prompts: the sample of its fidelity report.

A combination picks, uniformly, how many of the schema's top-level choices to make (1 up to
`max_imports`), then which: a choice is a module or a union (one member, uniformly; a union left out
keeps its default member, as any prompt does). Inside a picked module, each nested choice is made
with probability 1/2. Imports are written nested as in the schema, each top-level one inside an
element of its schema section's role, with the question in the user turn that holds the user
section's modules (or in a user turn of its own) and then `<assistant/>`: the chat turn the
playground composes. Parameters get a placeholder argument when it fits their slot.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

from promptcache.pml import Module, RoleSection, Schema, TextEncoder, Union

PLACEHOLDER_ARGUMENT = "example"
DRAWS_PER_SAMPLE = 20  # draws tried per distinct combination wanted: a small schema has few of them


@dataclass(frozen=True, slots=True)
class SampledPrompt:
    """One combination as a `<prompt>` document; `picked` lists the modules the sampler chose."""

    prompt: str
    picked: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Choice:
    """Import one of `members` (a module alone, or a union's members) or nothing."""

    members: tuple[Module, ...]
    section: RoleSection | None  # the top-level role section that holds it


def sample_prompts(schema: Schema, encoder: TextEncoder, *, num_samples: int, seed: int, question: str,
                   max_imports: int | None = None) -> list[SampledPrompt]:
    """Up to `num_samples` distinct combinations of `schema`'s modules, the same for the same arguments
    (fewer when the schema has fewer, or none turns up in DRAWS_PER_SAMPLE draws each)."""
    rng = random.Random(f"fidelity-report-{seed}")
    choices = _choices(schema.root.children, None, is_top=True)
    found: dict[str, SampledPrompt] = {}
    for _ in range(num_samples * DRAWS_PER_SAMPLE):
        if len(found) == num_samples:
            break
        sample = _draw(rng, schema, choices, encoder, question, max_imports)
        found.setdefault(sample.prompt, sample)
    return list(found.values())


def _choices(children, section: RoleSection | None, *, is_top: bool) -> list[_Choice]:
    choices: list[_Choice] = []
    for node in children:
        if isinstance(node, Module):
            choices.append(_Choice((node,), section))
        elif isinstance(node, Union):
            choices.append(_Choice(node.members, section))
        elif isinstance(node, RoleSection):  # transparent for imports; at the top it is the turn they go in
            choices += _choices(node.children, node if is_top else section, is_top=is_top)
    return choices


def _draw(rng: random.Random, schema: Schema, choices: list[_Choice], encoder: TextEncoder, question: str,
          max_imports: int | None) -> SampledPrompt:
    picked: list[str] = []
    groups: list[tuple[RoleSection | None, list[str]]] = []  # consecutive imports of one section
    if choices:
        count = rng.randint(1, min(len(choices), max_imports or len(choices)))
        for index in sorted(rng.sample(range(len(choices)), count)):  # schema order
            choice = choices[index]
            xml = _import(rng, rng.choice(choice.members), encoder, picked)
            if groups and groups[-1][0] is choice.section:
                groups[-1][1].append(xml)
            else:
                groups.append((choice.section, [xml]))
    body = [f"<{s.role}>{''.join(xs)}</{s.role}>" if s is not None else "".join(xs) for s, xs in groups]
    text = escape(question)
    if groups and groups[-1][0] is not None and groups[-1][0].role == "user":
        body[-1] = body[-1][: -len("</user>")] + text + "</user>"
    elif question.strip():
        body.append(f"<user>{text}</user>")
    return SampledPrompt(f'<prompt schema="{schema.name}">{"".join(body)}<assistant/></prompt>', tuple(picked))


def _import(rng: random.Random, module: Module, encoder: TextEncoder, picked: list[str]) -> str:
    picked.append(module.path)
    fits = len(encoder.encode(PLACEHOLDER_ARGUMENT))
    arguments = "".join(f" {name}={quoteattr(PLACEHOLDER_ARGUMENT)}" for name, param in module.params.items()
                        if fits <= param.length)
    inner = "".join(_import(rng, rng.choice(choice.members), encoder, picked)
                    for choice in _choices(module.children, None, is_top=False) if rng.random() < 0.5)
    return f"<{module.name}{arguments}>{inner}</{module.name}>" if inner else f"<{module.name}{arguments}/>"

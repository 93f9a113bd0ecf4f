"""Look-alike documents for the fidelity evaluation (benchmarks/evalset/tasks.py).

Each schema is one boilerplate notice (depot access, clinic, ferry line, storage room) written out
NUM_DOCS times: the documents share every sentence and differ only in the name of what they describe
and in one fact (a gate code, a doctor, a harbour, a load limit). A prompt imports k of them in random
order inside the user turn and asks the fact of one, so the answer must come from the right copy of
near-identical text. Modules sit in the schema's order whatever order a prompt names them in, so
prompts import them in that order. Generated from a seed; no downloads.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from xml.sax.saxutils import escape

from benchmarks.evalset.data import balanced
from benchmarks.evalset.template import CITIES, FIRST, LAST_SYLLABLES

NUM_DOCS = 20  # 8 of 20 is also the TTFT prompt of docs/fidelity.md
# Distinct words (no shared syllables, unlike made-up names): SmolLM2-135M tells them apart
NAMES = (
    "Maple", "Falcon", "Granite", "Harbor", "Juniper", "Copper", "Orchid", "Summit", "Cedar", "Lantern",
    "Meadow", "Bramble", "Thistle", "Anchor", "Beacon", "Canyon", "Delta", "Ember", "Glacier", "Heron",
    "Ivory", "Jasper", "Lagoon", "Marble", "Nutmeg", "Onyx", "Quartz", "Raven", "Timber", "Velvet", "Willow",
    "Acorn", "Birch", "Coral", "Fern", "Hazel", "Iris", "Lotus", "Walnut", "Aspen",
)
KS = (3, 5, 8)
SYSTEM = "Answer the question with a short phrase, using only the documents."


@dataclass(frozen=True)
class Notice:
    """One boilerplate: the document text around `{name}` and `{value}`, the question, the value kind."""

    kind: str
    text: str
    question: str
    value_kind: str


NOTICES = (
    Notice("depot", "Depot access sheet: the {name} depot. Visitors sign in at the front desk and wear a badge "
                    "at all times. Safety shoes are required in the loading area, and forklifts always have right "
                    "of way. Smoking is only allowed in the marked area behind the car park. Trucks wait in the "
                    "outer lane until a loading bay is free, with their engines switched off. The gate code of the "
                    "{name} depot is {value}. Deliveries are accepted on weekdays between seven in the morning and "
                    "four in the afternoon. Pallets that are broken or wet are refused at the gate. Any damage must "
                    "be reported to the shift supervisor before leaving the site.",
           "What is the gate code of the {name} depot?", "code"),
    Notice("clinic", "Clinic notice: the {name} clinic. Patients are asked to arrive ten minutes before their "
                     "appointment and to bring their insurance card. Prescriptions can be collected at the pharmacy "
                     "counter on the ground floor. Children under twelve must be accompanied by an adult, and "
                     "mobile phones should be silent in the treatment rooms. Blood tests are taken in the morning "
                     "only. The doctor on call at the {name} clinic is Dr. {value}. Parking is free for the first "
                     "two hours, and the waiting room closes at six in the evening. Cancelled appointments should "
                     "be reported one day in advance.",
           "Who is the doctor on call at the {name} clinic?", "person"),
    Notice("ferry", "Ferry line note: the {name} line. Tickets can be bought on board or at the harbour office, "
                    "and bicycles travel free of charge. Passengers should be at the pier fifteen minutes before "
                    "departure. Dogs are welcome on the outer deck if they are kept on a lead. Hot drinks and "
                    "sandwiches are sold in the lounge during the crossing. The ferry of the {name} line leaves "
                    "from the harbour of {value}. In stormy weather, crossings may be cancelled at short notice. "
                    "Lost items are kept at the harbour office for one month.",
           "From which harbour does the ferry of the {name} line leave?", "city"),
    Notice("storage", "Storage room card: the {name} room. Keep the door closed and the lights off when nobody "
                      "is inside. Boxes must be labelled with the date they were packed and stored on the lower "
                      "shelves. Heavy items go at the bottom, and nothing may block the fire exit. Liquids are "
                      "kept in sealed containers on the metal racks near the sink. The load limit of the shelves "
                      "in the {name} room is {value} kilograms. The room is cleaned every Friday afternoon. Report "
                      "a broken shelf or a leaking pipe to the building manager.",
           "What is the load limit of the shelves in the {name} room?", "load"),
)


def _value(rng: random.Random, kind: str) -> str:
    if kind == "code":
        return str(rng.randint(1000, 9999))
    if kind == "person":
        return f"{rng.choice(FIRST)} {''.join(rng.choice(LAST_SYLLABLES) for _ in range(2)).capitalize()}"
    if kind == "city":
        return rng.choice(CITIES)
    return str(rng.randrange(120, 990, 10))  # load


def _documents(rng: random.Random, notice: Notice) -> list[tuple[str, str, str]]:
    """NUM_DOCS (module name, entity name, value), names and values distinct within the schema."""
    names = rng.sample(NAMES, NUM_DOCS)
    values: list[str] = []
    while len(values) < NUM_DOCS:
        value = _value(rng, notice.value_kind)
        if value not in values:
            values.append(value)
    return [(f"doc{i}", name, value) for i, (name, value) in enumerate(zip(names, values))]


def schema_text(name: str, notice: Notice, docs: list[tuple[str, str, str]]) -> str:
    modules = "".join(f'<module name="{module}" xml:space="preserve">'
                      f'{escape(notice.text.format(name=entity, value=value))}\n\n</module>'
                      for module, entity, value in docs)
    return f'<schema name="{name}"><system>{escape(SYSTEM)}</system><user>{modules}</user></schema>'


def lookalike_items(count: int, seed: int) -> tuple[dict[str, str], list[tuple[str, str, tuple[str, ...], dict]]]:
    """One schema per notice and `count` items as (schema_name, prompt, answers, meta).

    k cycles with the item index; every (schema, document) is asked equally often, at balanced positions
    among the imported documents as far as the document's place in the schema allows.
    """
    rng = random.Random(f"lookalike-{seed}")
    documents = {f"lookalike_{notice.kind}": (notice, _documents(rng, notice)) for notice in NOTICES}
    ks = [KS[i % len(KS)] for i in range(count)]
    positions = {k: iter(balanced(rng, list(range(k)), ks.count(k))) for k in KS}
    targets = [(name, index) for name in documents for index in range(NUM_DOCS)]
    items = []
    for k, (name, index) in zip(ks, balanced(rng, targets, count)):
        notice, docs = documents[name]
        position, target = next(positions[k]), docs[index]
        # k - 1 others, `position` of them before the target in the schema (modules sit in layout order)
        before, after = docs[:index], docs[index + 1:]
        num_before = max(0, min(position, len(before), k - 1), k - 1 - len(after))
        chosen = [*sorted(rng.sample(before, num_before), key=docs.index), target,
                  *sorted(rng.sample(after, k - 1 - num_before), key=docs.index)]
        position = num_before
        imports = "".join(f"<{module}/>" for module, _, _ in chosen)
        question = notice.question.format(name=target[1])
        prompt = (f'<prompt schema="{name}"><user>{imports}Question: {escape(question)}</user>'
                  f"<assistant/></prompt>")
        meta = {"k": k, "target_position": position, "notice": notice.kind, "target": target[0],
                "modules": [module for module, _, _ in chosen]}
        items.append((name, prompt, (target[2],), meta))
    return {name: schema_text(name, notice, docs) for name, (notice, docs) in documents.items()}, items

"""Fictional towns with four facts each, in prose: the documents of the fact_qa task (and of serving workloads)."""

from __future__ import annotations

import random
from dataclasses import dataclass

SYLLABLES = ["ka", "lo", "mer", "vin", "to", "sa", "ren", "dal", "mi", "or", "bel", "tu", "ash", "pe", "qui", "zor"]
FILLER = [
    "The streets are narrow and paved with old grey stones that shine after the rain.",
    "Visitors often remark on the smell of bread from the bakeries near the square.",
    "In winter the hills around it turn white, and the roads are cleared before dawn.",
    "Most families keep small gardens, where they grow beans, onions and bright flowers.",
    "The local market opens on Saturday mornings and closes when the church bell rings at noon.",
    "Children walk to school along the river, which is lined with tall willow trees.",
    "An old stone bridge connects the two halves of the town and is said to be very old.",
    "The library holds letters and maps that describe how the region changed over the centuries.",
    "Fishermen still repair their nets by hand on the wooden piers in the early evening.",
    "A small museum displays tools, coins and clothing found by farmers in the fields nearby.",
]
FACTS = [
    ("mayor", "The mayor of {town} is a woman named {value}.", "Who is the mayor of {town}?"),
    ("river", "The river that flows through {town} is called the {value}.", "What is the river in {town} called?"),
    ("founded", "{town} was founded in the year {value}.", "In which year was {town} founded?"),
    ("dish", "The traditional dish of {town} is a stew called {value}.", "What is the traditional dish of {town}?"),
]


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


@dataclass(frozen=True)
class Document:
    name: str       # module name
    town: str
    text: str
    facts: dict[str, str]  # fact kind -> value


def make_documents(count: int, seed: int = 0) -> list[Document]:
    rng = random.Random(seed)
    docs = []
    for i in range(count):
        town = _name(rng, 3)
        values = {"mayor": f"{_name(rng, 2)} {_name(rng, 3)}", "river": _name(rng, 2),
                  "founded": str(rng.randint(1100, 1899)), "dish": _name(rng, 3).lower()}
        sentences = [f.format(town=town, value=values[kind]) for kind, f, _ in FACTS]
        filler = rng.sample(FILLER, len(FILLER))
        body = [f"{town} is a small town in a quiet valley."]
        for sentence, extra in zip(sentences, [filler[:2], filler[2:4], filler[4:6], filler[6:9]]):
            body += [sentence, *extra]
        docs.append(Document(f"doc{i}", town, " ".join(body), values))
    return docs


def balanced(rng: random.Random, values: list, count: int) -> list:
    """`count` values cycling through `values`, each pass in a fresh random order (every value is used
    equally often, and any prefix is as balanced as possible)."""
    out: list = []
    while len(out) < count:
        block = list(values)
        rng.shuffle(block)
        out += block
    return out[:count]

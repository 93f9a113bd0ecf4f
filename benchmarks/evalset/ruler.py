"""RULER-style needle retrieval for the fidelity evaluation (benchmarks/evalset/tasks.py).

Haystack chunks of neutral filler prose are the modules of a schema (len(SCHEMAS) schemas of NUM_CHUNKS
chunks, so there are many distinct needles to ask); each chunk hides one or more
"The special magic number for <key> is <7-digit number>." sentences (keys are distinct made-up words).
A prompt imports k chunks in random order and asks for the number of one key; the other keys in the
imported chunks are distractors (RULER's multi-key NIAH). Generated from a seed; no downloads.
"""

from __future__ import annotations

import random
from xml.sax.saxutils import escape

from benchmarks.evalset.data import balanced

SCHEMAS = ("haystack0", "haystack1")
NUM_CHUNKS = 24
NEEDLES_PER_CHUNK = 1  # more makes the task too hard for SmolLM2-135M (≈ 50 % with 2)
KS = (2, 4, 6)
SYSTEM = ("Read the text and answer the question with the special magic number only. The text hides "
          "several special magic numbers; give the one for the key that is asked.")
NEEDLE = "The special magic number for {key} is {number}."
QUESTION = "Question: What is the special magic number for {key} mentioned in the text above?"
_KEY_SYLLABLES = ["bra", "cle", "dro", "fen", "gal", "hix", "jun", "kep", "lom", "nus", "pav", "quo", "ris",
                  "sol", "tam", "vey", "wix", "yor", "zan", "mur"]
FILLER = [
    "The afternoon light moved slowly across the wooden floor of the reading room.",
    "A gardener trimmed the hedges along the path and swept the leaves into a neat pile.",
    "Most of the houses on the hill have blue shutters and small balconies full of plants.",
    "The train from the coast usually arrives a little late, but nobody seems to mind.",
    "In the kitchen, a pot of soup simmered on the stove while someone chopped carrots.",
    "The children spent the morning building a tower of blocks that kept falling over.",
    "Clouds gathered over the mountains, and the wind carried the smell of rain.",
    "An old clock in the hallway ticked loudly, and its chime could be heard upstairs.",
    "The bakery on the corner sells warm rolls and sweet pastries early in the morning.",
    "Along the canal, people walked their dogs and stopped to talk with their neighbours.",
    "The museum guide explained how the paintings had been restored over many years.",
    "A cat slept in the sun on the windowsill, ignoring the birds in the garden.",
    "The committee met in the evening to discuss the plans for the new playground.",
    "Fresh snow covered the fields, and the tracks of a fox crossed the white ground.",
    "The market stalls were full of apples, pears, cabbages and bunches of herbs.",
    "She folded the letter carefully and placed it in a drawer with the others.",
    "The old road winds through a forest of pine trees before it reaches the lake.",
    "During the storm the lights flickered, so the family lit candles on the table.",
    "The students listened quietly as the teacher read a story about a lost sailor.",
    "A small boat drifted near the shore while its owner repaired a torn sail.",
    "The village choir practises every week in the hall next to the fire station.",
    "On warm evenings the square fills with people eating ice cream and chatting.",
    "The bridge was painted green last summer, and it still looks bright and new.",
    "A delivery van stopped outside the shop, and two men unloaded boxes of books.",
    "The orchard behind the farmhouse is known for its sweet plums and cherries.",
    "He wrote his notes in pencil so that he could change them later if needed.",
    "The park has a pond where ducks gather whenever someone brings bread.",
    "Late in the autumn, the farmers bring their sheep down from the high pastures.",
    "The library closes early on Sundays, so the reading room is quiet by noon.",
    "A narrow staircase leads from the courtyard to a roof with a view of the harbour.",
    "The baker's son plays the violin, and his music drifts out of the open window.",
    "Heavy fog rolled in from the sea and hid the lighthouse for most of the day.",
    "The workshop smelled of sawdust, glue and the oil used to polish the tables.",
    "Every spring the town paints the benches along the river a fresh coat of white.",
    "Two friends played chess under a tree, thinking for a long time before each move.",
    "The hotel lobby was decorated with old photographs of ships and sailors.",
    "After dinner, the guests walked along the beach and watched the tide come in.",
    "The post office keeps a small collection of stamps from faraway countries.",
    "A light breeze moved the curtains, and the room filled with the scent of roses.",
    "The mechanic wiped his hands on a cloth and closed the hood of the old truck.",
]


def _keys(rng: random.Random, count: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < count:
        key = "".join(rng.sample(_KEY_SYLLABLES, 3))
        if key not in keys:
            keys.append(key)
    return keys


def _numbers(rng: random.Random, count: int) -> list[str]:
    numbers: list[str] = []
    while len(numbers) < count:
        number = str(rng.randint(1_000_000, 9_999_999))
        if number not in numbers:
            numbers.append(number)
    return numbers


def make_chunks(rng: random.Random, keys: list[str], numbers: list[str]) -> list[dict]:
    """NUM_CHUNKS chunks: {"name", "text", "needles": [(key, number), ...]} (text not yet escaped)."""
    chunks = []
    for c in range(NUM_CHUNKS):
        needles = [(keys[c * NEEDLES_PER_CHUNK + j], numbers[c * NEEDLES_PER_CHUNK + j])
                   for j in range(NEEDLES_PER_CHUNK)]
        sentences = rng.sample(FILLER, rng.randint(9, 12))
        # needles at distinct random places in the chunk, never before its first sentence
        slots = sorted(rng.sample(range(1, len(sentences) + 1), NEEDLES_PER_CHUNK), reverse=True)
        for slot, (key, number) in zip(slots, reversed(needles)):
            sentences.insert(slot, NEEDLE.format(key=key, number=number))
        chunks.append({"name": f"chunk{c}", "text": " ".join(sentences), "needles": needles})
    return chunks


def schema_text(name: str, chunks: list[dict]) -> str:
    modules = "".join(f'<module name="{c["name"]}" xml:space="preserve">{escape(c["text"])}\n\n</module>'
                      for c in chunks)
    return f'<schema name="{name}"><system>{escape(SYSTEM)}</system><user>{modules}</user></schema>'


def ruler_items(count: int, seed: int) -> tuple[dict[str, str], list[tuple[str, str, tuple[str, ...], dict]]]:
    """The schemas and `count` items as (schema_name, prompt, answers, meta).

    k cycles with the item index; each needle is asked equally often, at balanced positions.
    """
    rng = random.Random(f"ruler-{seed}")
    per_schema = NUM_CHUNKS * NEEDLES_PER_CHUNK
    keys, numbers = _keys(rng, len(SCHEMAS) * per_schema), _numbers(rng, len(SCHEMAS) * per_schema)
    chunks = {name: make_chunks(rng, keys[s * per_schema:], numbers[s * per_schema:])
              for s, name in enumerate(SCHEMAS)}
    ks = [KS[i % len(KS)] for i in range(count)]
    positions = {k: iter(balanced(rng, list(range(k)), ks.count(k))) for k in KS}
    needles = [(name, c, j) for name in SCHEMAS for c in range(NUM_CHUNKS) for j in range(NEEDLES_PER_CHUNK)]
    items = []
    for k, (name, target_index, needle_index) in zip(ks, balanced(rng, needles, count)):
        position, target = next(positions[k]), chunks[name][target_index]
        chosen = rng.sample([c for c in chunks[name] if c is not target], k - 1)
        chosen.insert(position, target)
        key, number = target["needles"][needle_index]
        imports = "".join(f"<{c['name']}/>" for c in chosen)
        prompt = (f'<prompt schema="{name}"><user>{imports}{escape(QUESTION.format(key=key))}</user>'
                  f"<assistant/></prompt>")
        meta = {"k": k, "target_position": position, "needle_position": position,
                "needle_in_chunk": needle_index, "key": key, "target": target["name"],
                "modules": [c["name"] for c in chosen], "num_keys": k * NEEDLES_PER_CHUNK}
        items.append((name, prompt, (number,), meta))
    return {name: schema_text(name, chunks[name]) for name in SCHEMAS}, items

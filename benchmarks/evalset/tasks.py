"""The fidelity evaluation set: prompts per task and prompt set (seed), generated in-repo (no downloads).

Tasks (each item is a `<prompt schema=...>` PML document with the question at the end of the user turn):
- fact_qa: documents about fictional towns (evalset/data.py: four facts each) are the modules of a
  schema's user section; a prompt imports k of the schema's 12 documents in random order and asks one
  fact of one of them. FACT_SCHEMAS schemas of 12 documents each, so the questions cover many facts.
- ruler: RULER-style multi-key needle retrieval over haystack chunks (evalset/ruler.py).
- template: a record module with `<param>` slots filled per prompt; the question asks one argument
  (evalset/template.py).
- lookalike: near-identical boilerplate documents that differ in a name and one fact; a prompt imports
  k of 20 and asks the fact of one (evalset/lookalike.py).
k cycles with the item index, so any prefix of a task's items is balanced over k; targets and target
positions are drawn in balanced random order. Each seed is a prompt set with schemas of its own.
"""

from __future__ import annotations

import random
import re
import unicodedata
from dataclasses import dataclass, replace
from xml.sax.saxutils import escape

from benchmarks.evalset.data import FACTS, Document, balanced, make_documents
from benchmarks.evalset.lookalike import lookalike_items
from benchmarks.evalset.ruler import ruler_items
from benchmarks.evalset.template import template_items

TASKS = ("fact_qa", "ruler", "template", "lookalike")
FACT_SCHEMAS = 4
FACT_DOCS = 12
FACT_KS = (2, 4, 6)
FACT_SYSTEM = "Answer the question with a short phrase, using only the documents."
# SmolLM2-135M answers "In which year was X founded?" from memory ("The answer is: 2018") every time
QUESTIONS = {kind: question for kind, _, question in FACTS} | {"founded": "What is the founding year of {town}?"}


@dataclass(frozen=True)
class EvalItem:
    task: str                  # one of TASKS
    schema_name: str           # the schema (a key of EvalSet.schemas) the prompt uses
    prompt: str                # the <prompt schema=...> PML document
    answers: tuple[str, ...]   # accepted answers (any one counts)
    meta: dict                 # for slicing results: seed, k, target_position, ... (JSON-serialisable)


@dataclass(frozen=True)
class EvalSet:
    schemas: dict[str, str]    # schema name -> <schema> PML text
    items: list[EvalItem]

    def by_task(self, task: str) -> list[EvalItem]:
        return [item for item in self.items if item.task == task]


_NOT_WORD = re.compile(r"[^\w\s]")


def normalize(text: str) -> str:
    """Lower case, punctuation removed (so "1,234,567" reads "1234567"), whitespace collapsed."""
    text = _NOT_WORD.sub("", unicodedata.normalize("NFKC", text).lower())
    return " ".join(text.split())


def score(answer_text: str, item: EvalItem) -> bool:
    """True when a normalised accepted answer occurs in the normalised answer text.

    A number must not be part of a longer number ("1234" does not match "12345").
    """
    text = normalize(answer_text)
    for answer in item.answers:
        wanted = normalize(answer)
        if not wanted:
            continue
        left = r"(?<!\d)" if wanted[0].isdigit() else ""
        right = r"(?!\d)" if wanted[-1].isdigit() else ""
        if re.search(left + re.escape(wanted) + right, text):
            return True
    return False


def _fact_documents(seed: int, index: int) -> list[Document]:
    """FACT_DOCS documents whose towns and fact values are distinct (so every question has one answer)."""
    for attempt in range(100):
        docs = make_documents(FACT_DOCS, seed=10_000 * seed + 100 * index + attempt)
        columns = [[d.town for d in docs]] + [[d.facts[kind] for d in docs] for kind, _, _ in FACTS]
        if all(len(set(column)) == len(column) for column in columns):
            return docs
    raise RuntimeError("no distinct document set found")  # pragma: no cover


def _fact_schema(name: str, docs: list[Document]) -> str:
    modules = "".join(f'<module name="{d.name}" xml:space="preserve">{escape(d.text)}\n\n</module>' for d in docs)
    return f'<schema name="{name}"><system>{escape(FACT_SYSTEM)}</system><user>{modules}</user></schema>'


def fact_qa_items(count: int, seed: int) -> tuple[dict[str, str], list[tuple[str, str, tuple[str, ...], dict]]]:
    """FACT_SCHEMAS schemas and `count` items as (schema_name, prompt, answers, meta).

    k cycles with the item index; every (document, fact) is asked equally often, at balanced positions.
    """
    rng = random.Random(f"fact_qa-{seed}")
    documents = {f"facts{s}": _fact_documents(seed, s) for s in range(FACT_SCHEMAS)}
    ks = [FACT_KS[i % len(FACT_KS)] for i in range(count)]
    positions = {k: iter(balanced(rng, list(range(k)), ks.count(k))) for k in FACT_KS}
    facts = [(name, doc, kind) for name, docs in documents.items() for doc in range(FACT_DOCS) for kind, _, _ in FACTS]
    items = []
    for k, (name, doc, kind) in zip(ks, balanced(rng, facts, count)):
        position, target = next(positions[k]), documents[name][doc]
        chosen = rng.sample([d for d in documents[name] if d is not target], k - 1)
        chosen.insert(position, target)
        imports = "".join(f"<{d.name}/>" for d in chosen)
        question = QUESTIONS[kind].format(town=target.town)
        prompt = (f'<prompt schema="{name}"><user>{imports}Question: {escape(question)}</user>'
                  f"<assistant/></prompt>")
        meta = {"k": k, "target_position": position, "fact": kind, "target": target.name,
                "modules": [d.name for d in chosen]}
        items.append((name, prompt, (target.facts[kind],), meta))
    return {name: _fact_schema(name, docs) for name, docs in documents.items()}, items


BUILDERS = {"fact_qa": fact_qa_items, "ruler": ruler_items, "template": template_items, "lookalike": lookalike_items}


def build_eval_set(*, per_task: int = 200, seeds: tuple[int, ...] = (0,), tasks: tuple[str, ...] = TASKS,
                   roles: bool = True) -> EvalSet:
    """`per_task` items of each task per seed, in TASKS order then seed order; the same arguments give
    identical schemas and items. Schemas of seed s > 0 are named "<name>-s<s>" (seed 0 keeps the names).
    `roles=False`: the same texts without role tags (`without_roles`)."""
    schemas: dict[str, str] = {}
    items: list[EvalItem] = []
    for task in (t for t in TASKS if t in tasks):
        for seed in seeds:
            task_schemas, task_items = BUILDERS[task](per_task, seed)
            rename = {name: name if seed == 0 else f"{name}-s{seed}" for name in task_schemas}
            assert not set(rename.values()) & set(schemas), "schema names must be unique across tasks"
            for name, text in task_schemas.items():
                schemas[rename[name]] = text.replace(f'<schema name="{name}"', f'<schema name="{rename[name]}"', 1)
            for schema, prompt, answers, meta in task_items:
                prompt = prompt.replace(f'<prompt schema="{schema}"', f'<prompt schema="{rename[schema]}"', 1)
                items.append(EvalItem(task, rename[schema], prompt, answers, {"seed": seed, **meta}))
    if not roles:
        schemas = {name: without_roles(text) for name, text in schemas.items()}
        items = [replace(item, prompt=without_roles(item.prompt)) for item in items]
    return EvalSet(schemas, items)


# Every task wraps its schema as <system>S</system><user>modules</user> and its prompt as <user>...</user><assistant/>.
_PLAIN_ROLES = (("<system>", ""), ("</system>", "\n\n"), ("<user>", ""), ("</user>", ""), ("<assistant/>", "\nAnswer:"))


def without_roles(pml: str) -> str:
    """`pml` with its role tags as plain text: the system text, a blank line, the user text, "Answer:". The prompt form
    for a model whose chat template PML cannot split into fixed per-role markup (Gemma's folds the system text into
    the first user turn), where role tags are refused."""
    for tag, text in _PLAIN_ROLES:
        pml = pml.replace(tag, text)
    return pml

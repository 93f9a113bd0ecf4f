"""Prompts of the serving benchmark, generated from fixed seeds (no downloads).

The workload of the llama.cpp comparison: a ~2K-token plain document with questions, the
retrieval mix (8 of 20 documents in random order, as plain chat and as PML) and an 8-turn chat.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.evalset.data import make_documents

SYSTEM = "Answer the question with a short phrase, using only the documents."
QUESTIONS = ["Who is the mayor of {town}?", "What is the river in {town} called?",
             "In which year was {town} founded?", "What is the traditional dish of {town}?"]
CHAT_TURNS = ["Which town has the oldest founding year?", "Who is its mayor?", "What river flows there?",
              "Name one dish from another town.", "Summarise the first document in one sentence.",
              "Which two towns share a letter at the start?", "What did you say about the river?",
              "Thank you. Which town would you visit?"]


@dataclass(frozen=True)
class Workload:
    document: str                 # ~2K tokens of plain prose (rows a, b)
    questions: list[str]          # distinct questions asked after the document
    retrieval_schema: str         # PML schema: the 20 documents as modules (row c)
    retrieval_pml: list[str]      # PML prompts importing 8 of them in random order
    retrieval_chat: list[list[dict[str, str]]]  # the same prompts as plain chat messages
    chat_system: str              # the long system message of the 8-turn chat (row d)
    chat_turns: list[str]


def build(*, num_docs: int = 20, pick: int = 8, num_retrieval: int = 20, doc_repeats: int = 10,
          seed: int = 0, role_tags: bool = True) -> Workload:
    """`doc_repeats` documents make the ~2K-token plain prompt (SmolLM2's tokenizer: ~200 each). `role_tags` False:
    the PML of row c is plain text (the system line, the modules, the question), for models whose chat template
    cannot be split per role (Gemma's moves the system text into the first user turn)."""
    rng = random.Random(seed)
    documents = make_documents(num_docs, seed)
    plain = "\n\n".join(d.text for d in documents[:doc_repeats])
    questions = [q.format(town=documents[i % doc_repeats].town) for i, q in
                 enumerate(QUESTIONS * 3)]
    modules = "".join(f'<module name="{d.name}">{d.text}\n\n</module>' for d in documents)
    schema = (f'<schema name="retrieval"><system>{SYSTEM}</system><user>{modules}</user></schema>' if role_tags
              else f'<schema name="retrieval">{SYSTEM}\n\n{modules}</schema>')
    pml, chats = [], []
    for _ in range(num_retrieval):
        chosen = rng.sample(documents, pick)
        target = rng.choice(chosen)
        question = rng.choice(QUESTIONS).format(town=target.town)
        imports = "".join(f"<{d.name}/>" for d in chosen)
        pml.append(f'<prompt schema="retrieval"><user>{imports}{question}</user><assistant/></prompt>' if role_tags
                   else f'<prompt schema="retrieval">{imports}{question}\nAnswer:</prompt>')
        chats.append([{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": "".join(d.text + "\n\n" for d in chosen) + question}])
    chat_system = SYSTEM + "\n\n" + "\n\n".join(d.text for d in documents[:5])
    return Workload(plain, questions, schema, pml, chats, chat_system, list(CHAT_TURNS))

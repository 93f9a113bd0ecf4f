"""Fidelity: what module caching does to answers, on the real SmolLM2-135M-Instruct.

    python benchmarks/fidelity.py --docs 8 --pick 3 --questions 40

Tasks (generated from fixed seeds, benchmarks/fidelity_data.py):
- fact_qa: documents of fictional facts as modules; each prompt imports k of them in random order and
  asks about one fact; accuracy = the fact appears in the greedy answer.
- fact_qa_scaffold: the same, importing one whole scaffold group (jointly encoded).
- template: a trip-planner module with <param> slots and a persona <union>; scored by agreement.
- prefix: a long system prompt + question, no optional parts: must be exact.
Modes side by side on the same prompts: full_prefill (the prompt's tokens at contiguous positions: what
a server without module caching computes), full_prefill_layout (same tokens at the schema's layout
positions: isolates the effect of position gaps), default (promptcache: guaranteed-context encoding),
isolated (each module encoded alone: the paper's literal masking).
Per task and mode: accuracy, agreement (first 16 greedy tokens equal to full_prefill), mean KL of the
first-token distribution vs full_prefill, mean TTFT. JSON lines; docs/fidelity.md has the table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.fidelity_data import make_documents, make_questions
from benchmarks.harness import RESULTS, emit, log, setup
from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelConfig, ModelRuntime, SamplingParams, load_model
from promptcache.model_runtime.baseline import full_prefill_greedy, full_prefill_logits
from promptcache.model_runtime.cached_prefill import prefill

MODES = ("full_prefill", "full_prefill_layout", "default", "isolated")
GENERATE = 24
AGREE = 16
SYSTEM = "Answer the question with a short phrase, using only the documents."


@dataclass
class Case:
    task: str
    prompt: str
    answer: str | None  # None: scored by agreement only


def build_cases(runtime: ModelRuntime, *, docs: int, pick: int, questions: int, seed: int = 0) -> list[Case]:
    documents = make_documents(docs, seed)
    modules = "".join(f'<module name="{d.name}">{d.text}</module>' for d in documents)
    groups = [[d.name for d in documents[i: i + pick]] for i in range(0, docs - pick + 1, pick)]
    scaffolds = "".join(f'<scaffold modules="{" ".join(g)}"/>' for g in groups)
    runtime.add_schema(runtime.parse_schema(
        f'<schema name="facts"><system>{SYSTEM}</system><user>{modules}</user>{scaffolds}</schema>'))
    cases = []
    for q in make_questions(documents, questions, pick, seed + 1):
        cases.append(Case("fact_qa", _qa_prompt(q.docs, q.text), q.answer))
    rng = random.Random(seed + 2)
    for i in range(max(2, questions // 4)):
        group = list(rng.choice(groups))
        rng.shuffle(group)
        target_name = rng.choice(group)
        target = next(d for d in documents if d.name == target_name)
        q = make_questions([target], 1, 1, seed + 10 + i)[0]
        cases.append(Case("fact_qa_scaffold", _qa_prompt(tuple(group), q.text), q.answer))
    runtime.add_schema(runtime.parse_schema(
        '<schema name="trip"><system>You are a travel agent. Answer in two sentences.</system><user>'
        '<union default="friendly"><module name="friendly">Speak in a warm, friendly tone.</module>'
        '<module name="formal">Speak in a formal, precise tone.</module>'
        '<module name="pirate">Speak like an old pirate captain.</module></union>'
        '<module name="plan">Plan a trip of <param name="days" len="3"/> days to <param name="city" len="6"/>. '
        'Mention one museum and one dish.</module></user></schema>'))
    cities = ["Paris", "Lisbon", "Kyoto", "Cairo", "Oslo", "Lima", "Rome", "Seoul"]
    for i in range(max(2, questions // 4)):
        persona = ["friendly", "formal", "pirate"][i % 3]
        cases.append(Case("template", f'<prompt schema="trip"><user><{persona}/><plan days="{2 + i % 5}" '
                                      f'city="{cities[i % len(cities)]}"/>Go.</user><assistant/></prompt>', None))
    long_system = " ".join(d.text for d in documents[:2])
    runtime.add_schema(runtime.parse_schema(f'<schema name="prefix"><system>{SYSTEM} {long_system}</system></schema>'))
    for i, d in enumerate(documents[:2] * max(1, questions // 8)):
        q = make_questions([d], 1, 1, seed + 100 + i)[0]
        cases.append(Case("prefix", f'<prompt schema="prefix"><user>{q.text}</user><assistant/></prompt>', q.answer))
    return cases


def _qa_prompt(doc_names: tuple[str, ...], question: str) -> str:
    imports = "".join(f"<{name}/>" for name in doc_names)
    return f'<prompt schema="facts"><user>{imports}Question: {question}</user><assistant/></prompt>'


def evaluate(runtime: ModelRuntime, cases: list[Case]) -> list[dict]:
    """One record per (case, mode): answer text, correctness, agreement, KL, TTFT."""
    model, tokenizer, eos = runtime.loaded.model, runtime.loaded.tokenizer, runtime.loaded.eos_token_ids
    params = SamplingParams(max_tokens=GENERATE, temperature=0)
    records = []
    for index, case in enumerate(cases):
        plan = runtime.plan(case.prompt)
        tokens, layout = plan.token_ids(), plan.position_ids()
        outputs: dict[str, tuple[list[int], torch.Tensor, float]] = {}
        for mode, positions in (("full_prefill", list(range(len(tokens)))), ("full_prefill_layout", layout)):
            started = time.perf_counter()
            logits = full_prefill_logits(model, tokens, positions)[-1]
            ttft = (time.perf_counter() - started) * 1e3
            outputs[mode] = (full_prefill_greedy(model, tokens, positions, GENERATE, eos), logits, ttft)
        for mode, mode_plan in (("default", plan), ("isolated", runtime.plan(case.prompt, isolated=True))):
            logits = prefill(runtime.module_encoder, mode_plan).logits
            result = runtime.generate(mode_plan, params)
            outputs[mode] = (list(result.token_ids), logits, result.timings.ttft_ms)
        reference_tokens, reference_logits, _ = outputs["full_prefill"]
        reference_logp = torch.log_softmax(reference_logits, -1)
        for mode, (generated, logits, ttft) in outputs.items():
            text = tokenizer.decode(generated, skip_special_tokens=True)
            kl = torch.sum(reference_logp.exp() * (reference_logp - torch.log_softmax(logits, -1))).item()
            records.append({
                "task": case.task, "case": index, "mode": mode, "exact_plan": plan.is_exact, "answer": text.strip(),
                "correct": None if case.answer is None else case.answer.lower() in text.lower(),
                "agrees": generated[:AGREE] == reference_tokens[:AGREE], "kl": max(kl, 0.0), "ttft_ms": ttft})
    return records


def summarize(records: list[dict]) -> list[dict]:
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["task"], r["mode"])].append(r)
    rows = []
    for (task, mode), rs in sorted(groups.items()):
        scored = [r["correct"] for r in rs if r["correct"] is not None]
        rows.append({"bench": "fidelity", "task": task, "mode": mode, "num_prompts": len(rs),
                     "accuracy": round(100 * sum(scored) / len(scored), 1) if scored else None,
                     "agreement": round(100 * sum(r["agrees"] for r in rs) / len(rs), 1),
                     "mean_kl": round(statistics.mean(r["kl"] for r in rs), 4),
                     "mean_ttft_ms": round(statistics.mean(r["ttft_ms"] for r in rs), 1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--pick", type=int, default=3)
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "fidelity.jsonl")
    args = parser.parse_args()
    setup(args.threads)
    runtime = ModelRuntime(load_model(ModelConfig()), build_store(StoreConfig(), device="cpu"))
    cases = build_cases(runtime, docs=args.docs, pick=args.pick, questions=args.questions)
    log(f"{len(cases)} prompts")
    records = evaluate(runtime, cases)
    for row in summarize(records):
        emit(row, args.out)
    with args.out.with_suffix(".answers.jsonl").open("w") as fh:
        import json

        for record in records:
            fh.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()

"""Does a schema's fidelity report predict the agreement its users get? On the fidelity evaluation's schemas
(benchmarks/evalset/), each schema's report (GET /v1/schemas/{name}/fidelity) against the greedy
first-token agreement measured on the evaluation's own prompts of that schema.

    python -m benchmarks.fidelity_report_check --per-task 200 --num-samples 16 [--tasks lookalike --max-imports 8]

Measured: every evaluation prompt served by a real `promptcache serve` (fp32) in `fast` and `balanced`
with the report's own k / positions / context, first token greedy, against an independent full prefill
of the prompt's tokens (Hugging Face forward in this process, after the server stopped: the oracle of
benchmarks/fidelity.py). Reports are asked twice per schema: with the report's default question and
with a question of the schema's task (its first evaluation prompt's: what "send one like your users'"
means), both with `max_imports` as many modules as the evaluation's prompts import at most.
One JSON line per (schema, question, mode) and per (task, question, mode) pooled over the task's
schemas: the report's agreement and 95 % interval, the measured agreement and its own interval, and
whether the measured value lies inside the report's interval.
"""

from __future__ import annotations

import argparse
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.evalset import TASKS, EvalItem, build_eval_set
from benchmarks.harness import RESULTS, emit, log, setup
from benchmarks.live_server import promptcache_server
from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelConfig, ModelRuntime, load_model
from promptcache.model_runtime.baseline import full_prefill_logits
from promptcache.server.fidelity import wilson

MODES = ("fast", "balanced")
_QUESTION = re.compile(r"/>([^<]*)</user>")


def task_question(item: EvalItem) -> str:
    """The question an evaluation prompt asks after its imports, in its user turn."""
    return _QUESTION.search(item.prompt).group(1).replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")


def reports(url: str, schemas: list[str], questions: dict[str, dict[str, str | None]], args) -> dict:
    """(schema, question label) -> the report, asked one at a time (each already batches its requests)."""
    found = {}
    for name in schemas:
        for label, question in questions[name].items():
            query = {"num_samples": args.num_samples, "seed": args.seed, "max_imports": args.max_imports}
            if question is not None:
                query["question"] = question
            response = httpx.get(f"{url}/v1/schemas/{name}/fidelity", params=query, timeout=3600)
            response.raise_for_status()
            found[(name, label)] = response.json()
            log(f"report {name} ({label}): {response.json()['elapsed_ms'] / 1e3:.0f} s")
    return found


def first_tokens(url: str, items: list[EvalItem], mode: str, options: dict, concurrency: int) -> list[int]:
    client = httpx.Client(timeout=1800)

    def ask(item: EvalItem) -> int:
        body = {"prompt": item.prompt, "max_tokens": 1, "temperature": 0, "fidelity": mode, **options}
        response = client.post(url + "/v1/generate", json=body)
        response.raise_for_status()
        return response.json()["choices"][0]["logprobs"]["token_ids"][0]

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(ask, items))


def reference_tokens(eval_set, items: list[EvalItem], dtype: str) -> list[int]:
    """Greedy first token of a plain full prefill of each prompt's tokens at positions 0..n-1."""
    loaded = load_model(ModelConfig(dtype=dtype, fuse_layers=False))  # HF's own modules
    runtime = ModelRuntime(loaded, build_store(StoreConfig()))
    for text in eval_set.schemas.values():
        runtime.add_schema(runtime.parse_schema(text), encode=False)
    tokens = []
    for index, item in enumerate(items):
        tokens.append(int(full_prefill_logits(loaded.model, runtime.plan(item.prompt).token_ids())[-1].argmax()))
        if index % 100 == 0:
            log(f"reference {index}/{len(items)}")
    return tokens


def row(kind: str, key: dict, agree_report: int, n_report: int, agree_measured: int, n_measured: int) -> dict:
    low, high = wilson(agree_report, n_report)
    m_low, m_high = wilson(agree_measured, n_measured)
    measured = agree_measured / n_measured
    return {"bench": kind, **key, "report_num_samples": n_report,
            "report_agreement": round(agree_report / n_report, 4), "report_ci95": [round(low, 4), round(high, 4)],
            "measured_num_prompts": n_measured, "measured_agreement": round(measured, 4),
            "measured_ci95": [round(m_low, 4), round(m_high, 4)], "within": bool(low <= measured <= high)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-task", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="of the evaluation set and of the reports' sampling")
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--max-imports", type=int, default=8, help="the evaluation's prompts import at most 8 "
                        "(lookalike; the other tasks 6)")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", type=Path, default=RESULTS / "fidelity_report_check.jsonl")
    args = parser.parse_args()
    setup(args.threads)
    eval_set = build_eval_set(per_task=args.per_task, seeds=(args.seed,), tasks=tuple(args.tasks))
    items = eval_set.items
    schemas = [name for name in eval_set.schemas if any(i.schema_name == name for i in items)]
    questions = {name: {"default": None, "task": task_question(next(i for i in items if i.schema_name == name))}
                 for name in schemas}
    with promptcache_server(["--dtype", args.dtype]) as url:
        for text in eval_set.schemas.values():
            httpx.post(url + "/v1/schemas", json={"pml": text}, timeout=1800).raise_for_status()
        found = reports(url, schemas, questions, args)
        some = next(iter(found.values()))
        options = {"fidelity_head_tokens": some["fidelity_head_tokens"], "logprobs": 0,
                   "fidelity_positions": some["fidelity_positions"], "fidelity_context": some["fidelity_context"]}
        answers = {}
        for mode in MODES:
            log(f"measured: {mode} on {len(items)} prompts")
            answers[mode] = first_tokens(url, items, mode, options, args.concurrency)
    log("reference: full prefill in-process")
    reference = reference_tokens(eval_set, items, args.dtype)
    settings = {k: v for k, v in options.items() if k != "logprobs"}
    for label in ("default", "task"):
        for task in sorted({i.task for i in items}):
            task_schemas = sorted({i.schema_name for i in items if i.task == task})
            for mode in MODES:
                pooled = [0, 0, 0, 0]
                for name in task_schemas:
                    report = found[(name, label)]
                    samples = report["samples"]
                    agree_report = sum(s["modes"][mode]["top1_agrees"] for s in samples)
                    index = [k for k, item in enumerate(items) if item.schema_name == name]
                    agree = sum(answers[mode][k] == reference[k] for k in index)
                    emit(row("fidelity_report_check", {"task": task, "schema": name, "question": label,
                                                       "mode": mode, **settings}, agree_report, len(samples),
                             agree, len(index)) | {"report_elapsed_s": round(report["elapsed_ms"] / 1e3, 1)},
                         args.out)
                    pooled = [pooled[0] + agree_report, pooled[1] + len(samples), pooled[2] + agree,
                              pooled[3] + len(index)]
                emit(row("fidelity_report_check_task", {"task": task, "question": label, "mode": mode, **settings},
                         *pooled), args.out)


if __name__ == "__main__":
    main()

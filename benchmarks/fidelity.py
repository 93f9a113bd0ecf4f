"""Fidelity: what reusing module KV does to answers, per fidelity mode, over HTTP on SmolLM2-135M-Instruct (or
`--model`, e.g. gemma3-270m).

    python -m benchmarks.fidelity --tasks lookalike --seeds 0 1 \\
        --modes exact fast balanced:16 balanced:32 balanced:64 --out benchmarks/results/fidelity_lookalike.jsonl
    python -m benchmarks.fidelity --tasks fact_qa ruler template --modes exact fast balanced \\
        --out benchmarks/results/fidelity_tasks.jsonl

A mode is "fidelity[:k][@positions][/context]": k is `fidelity_head_tokens`, positions
`fidelity_positions`, context `fidelity_context`; whatever a mode leaves out is the server's default
(so "fast" and "balanced" are the modes as shipped).

The evaluation set (benchmarks/evalset/) is generated in-repo from fixed seeds, one prompt set per seed; a model
whose chat template PML cannot split per role gets its texts without role tags (`--prompt-form`; a base model such as
Gemma 3 270M is best asked in the plain form too).
Reference: a plain full prefill of each prompt's tokens at contiguous positions with Hugging Face
transformers in this process (greedy, the independent oracle). Every promptcache mode runs through a real
`promptcache serve` (same model, `--dtype`, fp32 by default) with default settings but no automatic
prefix index (it changes no answer), the quality runs sent concurrently. TTFT is measured by this client
(streamed first token, one request at a time): full prefill on a `--no-prefix-caching` server in `exact`
mode (what a server without caching computes), the modes on a server that encoded every module's
encodings at upload (steady state: nothing of the timed prompts themselves is stored). The timed prompts
of the lookalike task import 8 of its 20 documents. Per task and mode: accuracy with a 95 % Wilson
interval (and per prompt set), % of the full-prefill accuracy, greedy 16-token agreement with the
reference (of --max-tokens generated), first-token KL (a lower bound, on the mode's top-20 tokens),
recomputed share of the reused module KV, median TTFT and its ratio to full prefill's; then every mode
paired with full prefill prompt by prompt (95 % interval).
JSON lines to --out (rewritten); every answer in a side file next to it (not committed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import httpx

from benchmarks.evalset import TASKS, EvalItem, EvalSet, build_eval_set, score
from benchmarks.evalset.answers import (
    GENERATE,
    Answer,
    Mode,
    cached_references,
    mode_answers,
    reference_answers,
    stored_references,
)
from benchmarks.evalset.stats import paired, summarize
from benchmarks.harness import RESULTS, emit, log, setup
from benchmarks.live_server import promptcache_server
from benchmarks.serving import Target
from promptcache.model_runtime import ModelConfig, load_model
from promptcache.pml import TextEncoder

FULL = "full_prefill"
TTFT_K = {"lookalike": 8}  # the task's timed prompts import this many documents (8 of 20)


def measure_ttft(url: str, items: list[EvalItem], mode: Mode) -> list[float]:
    """Client-side TTFT of streamed single requests, one at a time."""
    target = Target(mode.spec, url, is_promptcache=True)
    return [target.ttft("/v1/generate", {"prompt": item.prompt, "max_tokens": 1, **mode.fields()})[0]
            for item in items]


def upload(url: str, eval_set: EvalSet) -> None:
    for text in eval_set.schemas.values():
        httpx.post(url + "/v1/schemas", json={"pml": text}, timeout=1800).raise_for_status()


def timed_items(items: list[EvalItem], per_task: int) -> list[EvalItem]:
    """The first `per_task` items of each task (of its TTFT_K documents where the task names a k)."""
    timed = []
    for task in dict.fromkeys(item.task for item in items):
        k = TTFT_K.get(task)
        timed += [i for i in items if i.task == task and (k is None or i.meta["k"] == k)][:per_task]
    return timed


def run_servers(args: argparse.Namespace, eval_set: EvalSet, timed: list[EvalItem], modes: list[Mode],
                eos: set[int]) -> tuple[dict[str, list[float]], dict[str, list[Answer]]]:
    """TTFT of full prefill and of every mode, then every mode's answers, each on its own fresh server."""
    flags = ["--dtype", args.dtype, "--weights", args.weights, *(["--model", args.model] if args.model else [])]
    exact = Mode.parse("exact")
    warm = [item for item in eval_set.items if all(item is not t for t in timed)][-2:]  # never a timed prompt
    ttft: dict[str, list[float]] = {}
    with promptcache_server([*flags, "--no-prefix-caching"]) as url:  # what a server without caching computes
        upload(url, eval_set)
        measure_ttft(url, warm, exact)
        ttft[FULL] = measure_ttft(url, timed, exact)
    with promptcache_server([*flags, "--second-encodings-at-upload"]) as url:
        upload(url, eval_set)
        measure_ttft(url, warm, Mode.parse("fast"))
        for mode in modes:  # nothing of the timed prompts is stored yet; each mode's stream is its own
            ttft[mode.spec] = measure_ttft(url, timed, mode)
    answers: dict[str, list[Answer]] = {}
    # As shipped (second encodings made on first use), but without the automatic prefix index: it changes
    # no answer, and a thousand prompts' blocks would fill the tiers (5 GiB by default) for nothing.
    with promptcache_server([*flags, "--no-prefix-caching"]) as url:
        upload(url, eval_set)
        for mode in modes:
            log(f"quality run: {mode.spec}")
            answers[mode.spec] = mode_answers(url, eval_set.items, mode, concurrency=args.concurrency, eos_ids=eos,
                                              max_tokens=args.max_tokens)
    return ttft, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-task", type=int, default=200, help="prompts per task and prompt set")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="prompt sets")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--modes", nargs="+", default=["exact", "fast", "balanced"])
    parser.add_argument("--max-tokens", type=int, default=GENERATE, help="greedy tokens generated per prompt "
                        "(agreement is judged on the first 16)")
    parser.add_argument("--ttft-per-task", type=int, default=10, help="prompts per task timed one at a time")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="torch threads here and in the servers (1 on a "
                        "machine shared with other work: 2 threads wait for each other at every op)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="of the servers and of the in-process reference alike")
    parser.add_argument("--weights", choices=["native", "auto", "int8", "int4"], default="native",
                        help="the servers' linear weights (the in-process reference keeps the native ones)")
    parser.add_argument("--model", help="HF model path or hub id for the servers and the reference alike "
                                        "(default: the built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt-form", choices=["auto", "chat", "plain"], default="auto",
                        help="chat: the evaluation set's role tags; plain: the same texts without them "
                             "(evalset.tasks.without_roles); auto: plain where the model refuses role tags")
    parser.add_argument("--skip-servers", action="store_true", help="the in-process reference only")
    parser.add_argument("--reference-cache", type=Path,
                        help="keep the in-process full-prefill answers here (a .pt file) and reuse them when the "
                             "prompts match: the reference is a large part of a run's time")
    parser.add_argument("--reference-answers", type=Path,
                        help="an earlier run's .answers.jsonl on the same prompts: its full-prefill answers are the "
                             "reference (deterministic; agreement on re-tokenized text, no KL)")
    parser.add_argument("--out", type=Path, default=RESULTS / "fidelity_run.jsonl", help="rewritten")
    args = parser.parse_args()
    setup(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the servers' torch threads, as this process's
    args.out.unlink(missing_ok=True)
    loaded = load_model(ModelConfig(name_or_path=args.model, dtype=args.dtype, fuse_layers=False))  # HF's modules
    roles = args.prompt_form == "chat" or (
        args.prompt_form == "auto" and TextEncoder.from_tokenizer(loaded.tokenizer).chat_format_error is None)
    form = {"prompt_form": "chat" if roles else "plain"}
    eval_set = build_eval_set(per_task=args.per_task, seeds=tuple(args.seeds), tasks=tuple(args.tasks), roles=roles)
    items = eval_set.items
    timed = timed_items(items, args.ttft_per_task)
    modes = [] if args.skip_servers else [Mode.parse(spec) for spec in args.modes]
    log(f"{len(items)} prompts over {args.tasks}, seeds {args.seeds}, {form['prompt_form']} form; TTFT on {len(timed)}")

    if args.reference_answers:
        references = stored_references(args.reference_answers, items, loaded.tokenizer)
    else:  # first: a failed server run keeps it
        references = cached_references(args.reference_cache, items, lambda: reference_answers(
            loaded, eval_set, items, max_tokens=args.max_tokens))
    ttft, answers = run_servers(args, eval_set, timed, modes, set(loaded.eos_token_ids)) if modes else ({}, {})
    answers = {FULL: references, **answers}

    for task in dict.fromkeys(item.task for item in items):
        index = [i for i, item in enumerate(items) if item.task == task]
        task_timed = {id(item) for item in timed if item.task == task}
        full_ttft = [t for t, item in zip(ttft.get(FULL, []), timed) if id(item) in task_timed]
        for spec, mode_list in answers.items():
            task_ttft = [t for t, item in zip(ttft.get(spec, []), timed) if id(item) in task_timed]
            row = summarize(task, spec, [items[i] for i in index], [mode_list[i] for i in index],
                            [references[i] for i in index], task_ttft)
            if row["median_ttft_ms"] and full_ttft:
                row["ttft_vs_full_prefill"] = round(row["median_ttft_ms"] / statistics.median(full_ttft), 3)
            emit({**row, "seeds": args.seeds, "dtype": args.dtype, "weights": args.weights, **form}, args.out)
    for row in paired(items, answers, [FULL]):
        emit({**row, "seeds": args.seeds, "dtype": args.dtype, "weights": args.weights, **form}, args.out)
    with args.out.with_suffix(".answers.jsonl").open("w") as fh:
        for spec, mode_list in answers.items():
            for item, answer in zip(items, mode_list):
                fh.write(json.dumps({"mode": spec, "task": item.task, "meta": item.meta, "text": answer.text,
                                     "correct": score(answer.text, item), "recomputed": answer.recomputed}) + "\n")


if __name__ == "__main__":
    main()

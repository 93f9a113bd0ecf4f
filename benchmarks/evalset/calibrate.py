"""Checks and full-prefill calibration of the fidelity evaluation set (benchmarks/evalset/tasks.py).

    python -m benchmarks.evalset.calibrate --check                          # plan every prompt, token counts
    python -m benchmarks.evalset.calibrate --calibrate --n 30 --tasks lookalike   # full-prefill accuracy

Both parse the schemas and prompts with promptcache's own PML runtime (no module is encoded: nothing is
cached) to get each prompt's token ids. `calibrate` then runs greedy generation over those tokens at
contiguous positions 0..n-1 (a plain full prefill, what a server without module caching computes) and
scores the answers, per task and per k.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch

from benchmarks.evalset.tasks import TASKS, EvalItem, EvalSet, build_eval_set, normalize, score
from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelConfig, ModelRuntime, load_model
from promptcache.model_runtime.baseline import full_prefill_greedy


def _runtime(eval_set: EvalSet) -> ModelRuntime:
    runtime = ModelRuntime(load_model(ModelConfig()), build_store(StoreConfig(), device="cpu"))
    for text in eval_set.schemas.values():
        runtime.add_schema(runtime.parse_schema(text), encode=False)
    return runtime


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def check(eval_set: EvalSet, runtime: ModelRuntime | None = None) -> None:
    """Plan every prompt (raises on invalid PML or an argument longer than its slot), check that an
    accepted answer occurs in the prompt's text, and print token counts per task and k."""
    runtime = runtime or _runtime(eval_set)
    tokenizer = runtime.loaded.tokenizer
    counts: dict[tuple[str, object], list[int]] = defaultdict(list)
    for index, item in enumerate(eval_set.items):
        tokens = runtime.plan(item.prompt).token_ids()
        counts[(item.task, "all")].append(len(tokens))
        counts[(item.task, item.meta.get("k"))].append(len(tokens))
        context = normalize(tokenizer.decode(tokens))
        if not any(normalize(answer) in context for answer in item.answers):
            raise AssertionError(f"item {index} ({item.task}): no accepted answer in the prompt text")
    print(f"{len(eval_set.schemas)} schemas, {len(eval_set.items)} items; prompt tokens (min/median/max):")
    for (task, k), values in sorted(counts.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        print(f"  {task:9s} k={k!s:4s} n={len(values):4d}  "
              f"{min(values)}/{int(statistics.median(values))}/{max(values)}")


def calibrate(eval_set: EvalSet, *, n: int, tasks: list[str], start: int = 0, max_new_tokens: int = 24,
              threads: int = 2, verbose: bool = False) -> dict[str, float]:
    """Greedy full-prefill accuracy on items start..start+n-1 of each task; prints per task and per k."""
    torch.set_num_threads(threads)
    runtime = _runtime(eval_set)
    model, tokenizer = runtime.loaded.model, runtime.loaded.tokenizer
    eos = runtime.loaded.eos_token_ids
    results: dict[tuple[str, object], list[bool]] = defaultdict(list)
    started = time.perf_counter()
    for task in tasks:
        items: list[EvalItem] = eval_set.by_task(task)[start:start + n]
        for index, item in enumerate(items):
            tokens = runtime.plan(item.prompt).token_ids()
            generated = full_prefill_greedy(model, tokens, list(range(len(tokens))), max_new_tokens, eos)
            text = tokenizer.decode(generated, skip_special_tokens=True).strip()
            correct = score(text, item)
            results[(task, "all")].append(correct)
            results[(task, item.meta.get("k"))].append(correct)
            if verbose or index % 10 == 9:
                _log(f"[{time.perf_counter() - started:6.0f}s] {task} {index + 1}/{len(items)} "
                     f"k={item.meta.get('k')} tokens={len(tokens)} {'OK ' if correct else 'BAD'} "
                     f"want={item.answers[0]!r} got={text!r}")
    accuracy = {}
    elapsed_s = time.perf_counter() - started
    print(f"full-prefill greedy accuracy (items {start}..{start + n - 1} of each task, {elapsed_s:.0f} s):")
    for (task, k), values in sorted(results.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        pct = 100 * sum(values) / len(values)
        if k == "all":
            accuracy[task] = pct
        print(f"  {task:9s} k={k!s:4s} n={len(values):3d}  accuracy {pct:5.1f} %")
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibrate", action="store_true", help="full-prefill greedy accuracy on --n items per task")
    parser.add_argument("--check", action="store_true", help="plan every prompt; token counts; answers present")
    parser.add_argument("--n", type=int, default=30, help="items per task to calibrate on")
    parser.add_argument("--start", type=int, default=0, help="first item (per task) to calibrate on")
    parser.add_argument("--per-task", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--verbose", action="store_true", help="print every calibration answer")
    args = parser.parse_args()
    eval_set = build_eval_set(per_task=args.per_task, seeds=tuple(args.seeds), tasks=tuple(args.tasks))
    if args.check or not args.calibrate:
        check(eval_set)
    if args.calibrate:
        calibrate(eval_set, n=args.n, tasks=args.tasks, start=args.start, max_new_tokens=args.max_new_tokens,
                  threads=args.threads, verbose=args.verbose)


if __name__ == "__main__":
    main()

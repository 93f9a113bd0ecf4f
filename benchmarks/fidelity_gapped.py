"""Do position gaps cost answers? Full prefill at the PML layout's positions vs at contiguous positions.

    python -m benchmarks.fidelity_gapped --dtype bfloat16 --against benchmarks/results/fidelity_bf16.answers.jsonl

A prompt that imports k of a schema's M modules has its tokens at the layout's positions: gaps where the
modules it does not import would sit. Module reuse (`fast`) differs from a full prefill in two ways: the
gaps, and modules not attending to each other. This run keeps the attention and leaves only the gaps — a
plain full prefill of the same tokens at the layout's positions (fidelity.reference_answers with
`at_plan_positions`) — and pairs each prompt's correctness with an earlier run's contiguous full prefill
(`--against`, the same eval set and dtype). The gap between the two is the most that re-aligning reused
keys to contiguous positions (issue 12, item 3) could win back. Per task: accuracy with a 95 % Wilson
interval, the paired difference with its 95 % interval, how many answers changed correctness, and how
many answer texts are identical. One JSON line per task; every answer in a side file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.fidelity import paired_difference, reference_answers, wilson
from benchmarks.fidelity_tasks import build_eval_set, score
from benchmarks.harness import RESULTS, emit, log, setup
from promptcache.model_runtime import ModelConfig, load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, required=True,
                        help="an earlier fidelity run's .answers.jsonl (its full_prefill rows)")
    parser.add_argument("--per-task", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "fidelity_gapped.jsonl")
    args = parser.parse_args()

    setup(args.threads)
    contiguous = [row for row in map(json.loads, args.against.read_text().splitlines())
                  if row["mode"] == "full_prefill"]
    eval_set = build_eval_set(per_task=args.per_task, seed=args.seed)
    items = eval_set.items
    if len(contiguous) != len(items) or any(r["meta"] != i.meta for r, i in zip(contiguous, items)):
        raise SystemExit(f"{args.against} was not run on this eval set (--per-task {args.per_task}, --seed {args.seed})")
    loaded = load_model(ModelConfig(dtype=args.dtype, fuse_layers=False))  # HF's own modules
    log(f"{len(items)} prompts: full prefill at the layout's positions")
    gapped = reference_answers(loaded, eval_set, items, at_plan_positions=True)

    with args.out.with_suffix(".answers.jsonl").open("w") as fh:
        for item, answer in zip(items, gapped):
            fh.write(json.dumps({"mode": "full_prefill_gapped", "task": item.task, "meta": item.meta,
                                 "text": answer.text, "correct": score(answer.text, item)}) + "\n")
    for task in sorted({item.task for item in items}):
        rows = [(item, answer, then) for item, answer, then in zip(items, gapped, contiguous) if item.task == task]
        now = [score(answer.text, item) for item, answer, _ in rows]
        diffs = [int(n) - int(then["correct"]) for n, (_, _, then) in zip(now, rows)]
        mean, diff_low, diff_high = paired_difference(diffs)
        low, high = wilson(sum(now), len(now))
        emit({"bench": "fidelity_gapped", "task": task, "dtype": args.dtype, "against": args.against.name,
              "num_prompts": len(rows), "accuracy": round(100 * sum(now) / len(now), 1),
              "ci95": [round(low, 1), round(high, 1)],
              "contiguous_accuracy": round(100 * sum(then["correct"] for *_, then in rows) / len(rows), 1),
              "accuracy_diff_points": mean, "diff_ci95_points": [diff_low, diff_high],
              "num_changed": sum(d != 0 for d in diffs),
              "same_text": round(100 * sum(answer.text == then["text"] for _, answer, then in rows) / len(rows), 1)},
             args.out)


if __name__ == "__main__":
    main()

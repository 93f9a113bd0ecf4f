"""Pool runs of the fidelity evaluation on different prompt sets (seeds): accuracy and paired differences
over every prompt of every run, from the runs' stored answers.

    python -m benchmarks.fidelity_pooled benchmarks/results/fidelity_context.answers.jsonl \
        benchmarks/results/fidelity_seed1.answers.jsonl --modes balanced:16@contiguous/predecessor \
        --against full_prefill fast@contiguous --out benchmarks/results/fidelity_pooled.jsonl

Each run's answers pair prompt by prompt (every mode answered the same prompts, in the same order); pooling
concatenates the pairs, so a 200-prompt run per seed gives a 400-prompt interval per task. Only the modes
present in every run are pooled; the numbers are measured (each answer came from its run), the pooling is
arithmetic on them.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from benchmarks.fidelity import paired_difference, wilson
from benchmarks.harness import RESULTS, emit


def correctness(path: Path) -> dict[tuple[str, str], list[bool]]:
    """(task, mode) -> whether each answer was right, in the run's prompt order."""
    out: dict[tuple[str, str], list[bool]] = defaultdict(list)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        out[(row["task"], row["mode"])].append(bool(row["correct"]))
    return out


def pooled_rows(runs: list[Path], modes: list[str], against: list[str]) -> list[dict]:
    """Per task: each mode's and base's pooled accuracy, then each mode minus each base, paired."""
    loaded = [correctness(path) for path in runs]
    tasks = sorted({task for run in loaded for task, _ in run})
    rows = []
    for task in tasks:
        for mode in [*against, *modes]:
            if not all((task, mode) in run for run in loaded):
                continue
            right = [c for run in loaded for c in run[(task, mode)]]
            full = [c for run in loaded for c in run[(task, "full_prefill")]]
            low, high = wilson(sum(right), len(right))
            rows.append({"bench": "fidelity_pooled", "task": task, "mode": mode, "runs": [p.name for p in runs],
                         "num_prompts": len(right), "accuracy": round(100 * sum(right) / len(right), 1),
                         "ci95": [round(low, 1), round(high, 1)],
                         "percent_of_full_prefill": round(100 * sum(right) / sum(full), 1) if sum(full) else None})
        for mode in modes:
            for base in against:
                if not all((task, mode) in run and (task, base) in run for run in loaded):
                    continue
                diffs = [int(a) - int(b) for run in loaded for a, b in zip(run[(task, mode)], run[(task, base)],
                                                                         strict=True)]
                mean, low, high = paired_difference(diffs)
                rows.append({"bench": "fidelity_pooled_paired", "task": task, "mode": mode, "against": base,
                             "num_prompts": len(diffs), "accuracy_diff_points": mean, "ci95_points": [low, high],
                             "num_changed": sum(d != 0 for d in diffs)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="fidelity .answers.jsonl files, one per prompt set")
    parser.add_argument("--modes", nargs="+", required=True)
    parser.add_argument("--against", nargs="+", default=["full_prefill"])
    parser.add_argument("--out", type=Path, default=RESULTS / "fidelity_pooled.jsonl")
    args = parser.parse_args()
    for row in pooled_rows(args.runs, args.modes, args.against):
        emit(row, args.out)


if __name__ == "__main__":
    main()

"""Summary rows of the evaluation: accuracy with Wilson intervals, paired differences, agreement, KL."""

from __future__ import annotations

import math
import statistics

from benchmarks.evalset.answers import AGREE, Answer
from benchmarks.evalset.tasks import EvalItem, score
from promptcache.server.fidelity import wilson as report_interval


def first_token_kl(reference: Answer, answer: Answer) -> float | None:
    """KL(reference || mode) of the first-token distributions on the mode's top tokens + the rest (None
    when the reference's distribution is not known)."""
    if not reference.first_top:
        return None
    support = list(answer.first_top)
    p = [math.exp(reference.first_top[t]) for t in support]
    q = [math.exp(answer.first_top[t]) for t in support]
    p_rest, q_rest = max(1e-12, 1 - sum(p)), max(1e-12, 1 - sum(q))
    kl = sum(pi * (math.log(max(pi, 1e-30)) - math.log(max(qi, 1e-30))) for pi, qi in zip(p, q))
    return max(0.0, kl + p_rest * (math.log(p_rest) - math.log(q_rest)))


def wilson(successes: int, n: int) -> tuple[float, float]:
    """95 % Wilson interval of a proportion, in percent (the fidelity report's interval)."""
    if n == 0:
        return 0.0, 0.0
    low, high = report_interval(successes, n)
    return 100 * low, 100 * high


def paired_difference(diffs: list[int]) -> tuple[float, float, float]:
    """Mean of per-prompt differences (each -1/0/+1) in points, with its 95 % interval."""
    mean = statistics.mean(diffs)
    half = 1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
    return round(100 * mean, 1), round(100 * (mean - half), 1), round(100 * (mean + half), 1)


def summarize(task: str, mode: str, items: list[EvalItem], answers: list[Answer], references: list[Answer],
              ttft_ms: list[float]) -> dict:
    """One row per (task, mode): accuracy (95 % CI; per prompt set too), % of full prefill, greedy
    agreement, first-token KL, recomputed share of the reused module tokens, median TTFT."""
    correct = [score(a.text, item) for a, item in zip(answers, items)]
    reference_correct = [score(r.text, item) for r, item in zip(references, items)]
    accuracy = 100 * sum(correct) / len(correct)
    full = 100 * sum(reference_correct) / len(reference_correct)
    low, high = wilson(sum(correct), len(correct))
    reused = sum(a.reused_module_tokens + a.recomputed for a in answers)
    kls = [first_token_kl(r, a) for a, r in zip(answers, references)]
    by_seed: dict[int, list[bool]] = {}
    for item, ok in zip(items, correct):
        by_seed.setdefault(item.meta.get("seed", 0), []).append(ok)
    return {
        "bench": "fidelity", "task": task, "mode": mode, "num_prompts": len(items),
        "accuracy": round(accuracy, 1), "ci95": [round(low, 1), round(high, 1)],
        "accuracy_by_seed": {str(s): round(100 * sum(v) / len(v), 1) for s, v in sorted(by_seed.items())},
        "percent_of_full_prefill": round(100 * accuracy / full, 1) if full else None,
        "agreement": round(100 * sum(a.token_ids[:AGREE] == r.token_ids[:AGREE]
                                     for a, r in zip(answers, references)) / len(items), 1),
        "first_token_kl": round(statistics.mean(kls), 4) if None not in kls else None,
        "recomputed_fraction": round(sum(a.recomputed for a in answers) / reused, 4) if reused else 0.0,
        "median_ttft_ms": round(statistics.median(ttft_ms), 1) if ttft_ms else None,
    }


def paired(items: list[EvalItem], answers: dict[str, list[Answer]], against: list[str]) -> list[dict]:
    """Per task: every mode minus each mode in `against`, on the same prompts, with the 95 % interval of the
    paired difference and how many answers changed correctness."""
    rows = []
    for base in (b for b in against if b in answers):
        for spec, mode_list in answers.items():
            if spec == base:
                continue
            for task in sorted({item.task for item in items}):
                diffs = [int(score(a.text, item)) - int(score(b.text, item))
                         for item, a, b in zip(items, mode_list, answers[base]) if item.task == task]
                mean, low, high = paired_difference(diffs)
                rows.append({"bench": "fidelity_paired", "task": task, "mode": spec, "against": base,
                             "num_prompts": len(diffs), "accuracy_diff_points": mean, "ci95_points": [low, high],
                             "num_changed": sum(d != 0 for d in diffs)})
    return rows

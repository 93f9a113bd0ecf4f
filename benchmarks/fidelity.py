"""Fidelity: what reusing module KV does to answers, per fidelity mode, over HTTP on SmolLM2-135M-Instruct.

    python -m benchmarks.fidelity --per-task 200 --modes fast balanced:8 balanced:16 balanced:32 exact
    python -m benchmarks.fidelity --modes fast fast@contiguous balanced:32@contiguous --paired-against full_prefill fast

A mode is "fidelity[:k][@positions][/context]": k is `fidelity_head_tokens`, positions `fidelity_positions`
(contiguous: reused keys re-aligned; default here: layout, the meaning of rows recorded before it existed),
context `fidelity_context` (predecessor: modules' second encoding, after the module before them; default
schema).

The evaluation set (benchmarks/fidelity_tasks.py) is generated in-repo from fixed seeds: multi-document
fact QA (k of M documents in random order), RULER-style key retrieval, a parameterised template.
Reference: a plain full prefill of each prompt's tokens at contiguous positions with Hugging Face
transformers in this process (greedy, the independent oracle). Every promptcache mode runs through a
real `promptcache serve` (same model and dtype, `--dtype`, fp32 by default) with the request's `fidelity`; TTFT is measured by this
client (streamed first token, sequential, fresh servers), the quality runs are sent concurrently.
Per task and mode: accuracy with a 95 % Wilson interval, % of the full-prefill accuracy, greedy
16-token agreement with the reference (of 32 generated), first-token KL from the reference (on the mode's top-20
tokens + the rest: a lower bound of the full KL), recomputed fraction of the reused module KV, and
median TTFT. One JSON line per (task, mode), every answer in a side file, a PNG of accuracy vs TTFT.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from benchmarks.fidelity_tasks import EvalItem, EvalSet, build_eval_set, score
from benchmarks.harness import RESULTS, emit, log, setup
from benchmarks.live_server import promptcache_server
from benchmarks.serving import Target
from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import LoadedModel, ModelConfig, ModelRuntime, load_model
from promptcache.model_runtime.baseline import full_prefill_generate

GENERATE = 32  # a 7-digit answer after a short preamble needs more than 16 tokens
AGREE = 16     # greedy agreement is judged on the first 16 tokens
TOP = 20


@dataclass
class Answer:
    """One prompt answered by one mode."""

    text: str
    token_ids: list[int]
    first_top: dict[int, float]   # first token: id -> logprob (top-20), or the full distribution
    recomputed: int = 0
    reused_module_tokens: int = 0


def parse_mode(spec: str) -> tuple[str, int | None, str, str]:
    """"mode[:k][@positions][/context]" -> (mode, k, positions, context); positions default to the schema
    layout's (the meaning of the recorded rows without "@", from before re-alignment existed), the
    context to the schema's (`fidelity_context`)."""
    spec, _, context = spec.partition("/")
    spec, _, positions = spec.partition("@")
    mode, _, k = spec.partition(":")
    return mode, int(k) if k else None, positions or "layout", context or "schema"


def request_fields(mode: str, k: int | None, positions: str, context: str = "schema") -> dict:
    return {"fidelity": mode, "fidelity_positions": positions, "fidelity_context": context,
            **({"fidelity_head_tokens": k} if k is not None else {})}


def reference_answers(loaded: LoadedModel, eval_set: EvalSet, items: list[EvalItem], *,
                      at_plan_positions: bool = False) -> list[Answer]:
    """Plain full prefill of every prompt's tokens at positions 0..n-1 (no promptcache code on the path
    but the PML parser that turns the prompt into tokens). `at_plan_positions`: at the positions the PML
    layout gives them instead (gaps where the schema has modules the prompt does not import): what module
    reuse would give if cross-attention between modules were kept and only the position gaps remained —
    the most that re-aligning reused keys to contiguous positions could win back."""
    runtime = ModelRuntime(loaded, build_store(StoreConfig()))
    for text in eval_set.schemas.values():
        runtime.add_schema(runtime.parse_schema(text), encode=False)
    answers = []
    for index, item in enumerate(items):
        plan = runtime.plan(item.prompt)
        tokens = plan.token_ids()
        positions = plan.position_ids() if at_plan_positions else list(range(len(tokens)))
        generated, first_logits = full_prefill_generate(loaded.model, tokens, positions, GENERATE,
                                                        loaded.eos_token_ids)
        logprobs = torch.log_softmax(first_logits, dim=-1)
        generated = _until_eos(generated, loaded.eos_token_ids)
        text = loaded.tokenizer.decode(generated, skip_special_tokens=True)
        answers.append(Answer(text, generated, dict(enumerate(logprobs.tolist()))))
        if index % 50 == 0:
            log(f"reference {index}/{len(items)}")
    return answers


def mode_answers(url: str, items: list[EvalItem], mode: str, k: int | None, positions: str, context: str = "schema", *,
                 concurrency: int, eos_ids: set[int]) -> list[Answer]:
    client = httpx.Client(timeout=1800)

    def ask(item: EvalItem) -> Answer:
        body = {"prompt": item.prompt, "max_tokens": GENERATE, "temperature": 0, "logprobs": TOP,
                **request_fields(mode, k, positions, context)}
        # The mode's recompute, from explain: the response counts only what the request recomputed itself,
        # and prompts sharing a prefix (the TTFT phase's, or each other's) reuse recomputed blocks.
        explained = client.post(url + "/v1/prompts/explain", json={"prompt": item.prompt,
                                                                   **request_fields(mode, k, positions, context)})
        explained.raise_for_status()
        response = client.post(url + "/v1/generate", json=body)
        response.raise_for_status()
        data = response.json()
        logprobs = data["choices"][0]["logprobs"]
        token_ids = _until_eos(logprobs["token_ids"], eos_ids)
        first = dict(zip(logprobs["top_token_ids"][0], logprobs["top_token_logprobs"][0]))
        reused = sum(m["num_tokens"] for m in data["cache"]["modules"])
        return Answer(data["choices"][0]["text"], token_ids, first, explained.json()["recomputed_tokens"], reused)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(ask, items))


def _until_eos(token_ids: list[int], eos_ids) -> list[int]:
    for i, token in enumerate(token_ids):
        if token in eos_ids:
            return list(token_ids[:i])
    return list(token_ids)


def first_token_kl(reference: Answer, answer: Answer) -> float:
    """KL(reference || mode) of the first-token distributions on the mode's top tokens + the rest."""
    support = list(answer.first_top)
    p = [math.exp(reference.first_top[t]) for t in support]
    q = [math.exp(answer.first_top[t]) for t in support]
    p_rest, q_rest = max(1e-12, 1 - sum(p)), max(1e-12, 1 - sum(q))
    kl = sum(pi * (math.log(max(pi, 1e-30)) - math.log(max(qi, 1e-30))) for pi, qi in zip(p, q))
    return max(0.0, kl + p_rest * (math.log(p_rest) - math.log(q_rest)))


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 0.0
    phat = successes / n
    centre = (phat + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return 100 * (centre - half), 100 * (centre + half)


def paired_difference(diffs: list[int]) -> tuple[float, float, float]:
    """Mean of per-prompt differences (now - then, each -1/0/+1) in points, with its 95 % interval."""
    mean = statistics.mean(diffs)
    half = 1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
    return round(100 * mean, 1), round(100 * (mean - half), 1), round(100 * (mean + half), 1)


def summarize(task: str, mode: str, items: list[EvalItem], answers: list[Answer], references: list[Answer],
              ttft_ms: list[float]) -> dict:
    correct = [score(a.text, item) for a, item in zip(answers, items)]
    reference_correct = [score(r.text, item) for r, item in zip(references, items)]
    accuracy = 100 * sum(correct) / len(correct)
    full = 100 * sum(reference_correct) / len(reference_correct)
    low, high = wilson(sum(correct), len(correct))
    reused = sum(a.reused_module_tokens + a.recomputed for a in answers)
    return {
        "bench": "fidelity", "task": task, "mode": mode, "num_prompts": len(items),
        "accuracy": round(accuracy, 1), "ci95": [round(low, 1), round(high, 1)],
        "percent_of_full_prefill": round(100 * accuracy / full, 1) if full else None,
        "agreement": round(100 * sum(a.token_ids[:AGREE] == r.token_ids[:AGREE]
                                     for a, r in zip(answers, references)) / len(items), 1),
        "first_token_kl": round(statistics.mean(first_token_kl(r, a) for a, r in zip(answers, references)), 4),
        "recomputed_fraction": round(sum(a.recomputed for a in answers) / reused, 4) if reused else 0.0,
        "median_ttft_ms": round(statistics.median(ttft_ms), 1) if ttft_ms else None,
    }


def measure_ttft(url: str, items: list[EvalItem], mode: str, k: int | None, positions: str = "layout",
                 context: str = "schema") -> list[float]:
    """Client-side TTFT of streamed single requests, one at a time."""
    target = Target(mode, url, is_promptcache=True)
    extra = request_fields(mode, k, positions, context)
    return [target.ttft("/v1/generate", {"prompt": item.prompt, "max_tokens": 1, **extra})[0] for item in items]


def upload(url: str, eval_set: EvalSet) -> None:
    for text in eval_set.schemas.values():
        httpx.post(url + "/v1/schemas", json={"pml": text}, timeout=1800).raise_for_status()


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    tasks = sorted({r["task"] for r in rows})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for row in (r for r in rows if r["task"] == task and r["median_ttft_ms"]):
            low, high = row["ci95"]
            ax.errorbar(row["median_ttft_ms"], row["accuracy"], yerr=[[row["accuracy"] - low], [high - row["accuracy"]]],
                        fmt="o", capsize=3)
            ax.annotate(row["mode"], (row["median_ttft_ms"], row["accuracy"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
        ax.set_xscale("log")
        # plain numbers at 1-1.5-2-3-5-7 steps: a narrow log range (the template task's) gets readable labels
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("median TTFT over HTTP (ms, log)")
        ax.set_ylabel("accuracy (%, 95 % CI)")
        ax.set_title(task)
    fig.suptitle("SmolLM2-135M-Instruct, fp32, 2 CPU cores: accuracy vs TTFT per fidelity mode")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-task", type=int, default=200)
    parser.add_argument("--modes", nargs="+", default=["fast", "balanced:8", "balanced:16", "balanced:32", "exact"])
    parser.add_argument("--ttft-per-task", type=int, default=20, help="prompts per task timed one at a time")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="of the servers and of the in-process reference alike")
    parser.add_argument("--model", help="HF model path or hub id for the servers and the reference alike "
                                        "(default: the built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--gapped-reference", action="store_true",
                        help="also a full prefill at the PML layout's positions (row full_prefill_gapped)")
    parser.add_argument("--skip-servers", action="store_true", help="in-process references only (no --modes)")
    parser.add_argument("--compare-to", type=Path, help="an earlier run's .answers.jsonl (e.g. fp32): paired "
                                                          "accuracy difference per task and mode, prompt by prompt")
    parser.add_argument("--paired-against", nargs="*", default=["full_prefill"],
                        help="modes every other mode is paired with, prompt by prompt (rows fidelity_paired)")
    parser.add_argument("--reference-cache", type=Path,
                        help="keep the in-process full-prefill answers here (a .pt file) and reuse them when the "
                             "eval set and dtype match: the reference is most of a run's time")
    parser.add_argument("--out", type=Path, default=RESULTS / "fidelity.jsonl")
    args = parser.parse_args()
    setup(args.threads)
    loaded = load_model(ModelConfig(name_or_path=args.model, dtype=args.dtype, fuse_layers=False))  # HF's modules
    flags = ["--dtype", args.dtype, *(["--model", args.model] if args.model else [])]
    eos = set(loaded.eos_token_ids)
    eval_set = build_eval_set(per_task=args.per_task, seed=args.seed)
    items = eval_set.items
    tasks = sorted({item.task for item in items})
    timed = [i for task in tasks for i in [it for it in items if it.task == task][: args.ttft_per_task]]
    log(f"{len(items)} prompts over {tasks}; TTFT on {len(timed)}")

    ttft: dict[str, list[float]] = {"full_prefill": []}
    answers: dict[str, list[Answer]] = {}
    if not args.skip_servers:
        with promptcache_server([*flags, "--no-prefix-caching"]) as url:  # what a server without caching computes
            upload(url, eval_set)
            measure_ttft(url, timed[:2], "exact", None)  # warm-up
            ttft["full_prefill"] = measure_ttft(url, timed, "exact", None)
        # A mode reusing second encodings: the server encodes them at upload, as such a server would.
        preceded = any(parse_mode(spec)[3] == "predecessor" for spec in args.modes)
        with promptcache_server([*flags, *(["--fidelity-context", "predecessor"] if preceded else [])]) as url:
            upload(url, eval_set)
            measure_ttft(url, timed[:2], "fast", None)
            for spec in args.modes:  # timed first, on a fresh server: nothing of these prompts is stored yet
                ttft[spec] = measure_ttft(url, timed, *parse_mode(spec))
            for spec in args.modes:
                log(f"quality run: {spec}")
                answers[spec] = mode_answers(url, items, *parse_mode(spec), concurrency=args.concurrency,
                                             eos_ids=eos)
    else:
        args.modes = []
    references = cached_references(args.reference_cache, items, lambda: reference_answers(loaded, eval_set, items))
    answers["full_prefill"] = references
    modes = list(args.modes)
    if args.gapped_reference:
        log("reference at the layout's positions: full prefill in-process")
        answers["full_prefill_gapped"] = reference_answers(loaded, eval_set, items, at_plan_positions=True)
        ttft["full_prefill_gapped"] = []
        modes.append("full_prefill_gapped")

    rows = []
    for task in tasks:
        index = [i for i, item in enumerate(items) if item.task == task]
        task_items = [items[i] for i in index]
        task_timed = {id(item) for item in timed if item.task == task}
        for spec in ["full_prefill", *modes]:
            task_ttft = [t for t, item in zip(ttft[spec], timed) if id(item) in task_timed]
            row = summarize(task, spec, task_items, [answers[spec][i] for i in index],
                            [references[i] for i in index], task_ttft)
            rows.append(row)
            emit(row, args.out)
    with args.out.with_suffix(".answers.jsonl").open("w") as fh:
        for spec, mode_list in answers.items():
            for item, answer in zip(items, mode_list):
                fh.write(json.dumps({"mode": spec, "task": item.task, "meta": item.meta, "text": answer.text,
                                     "correct": score(answer.text, item), "recomputed": answer.recomputed}) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    for row in paired(items, answers, args.paired_against, args.dtype):
        emit(row, args.out)
    if args.compare_to:
        for row in compare(items, answers, args.compare_to, args.dtype):
            emit(row, args.out)


def cached_references(path: Path | None, items: list[EvalItem], compute) -> list[Answer]:
    """`compute()`'s answers, loaded from `path` when it holds answers to these very prompts."""
    prompts = [item.prompt for item in items]
    if path is not None and path.exists():
        saved = torch.load(path)
        if saved["prompts"] == prompts:
            log(f"reference: loaded from {path}")
            return [Answer(text, ids, dict(enumerate(logprobs.tolist())))
                    for text, ids, logprobs in zip(saved["texts"], saved["token_ids"], saved["first_logprobs"])]
    log("reference: full prefill in-process")
    answers = compute()
    if path is not None:
        first = torch.stack([torch.tensor([a.first_top[i] for i in range(len(a.first_top))]) for a in answers])
        torch.save({"prompts": prompts, "texts": [a.text for a in answers],
                    "token_ids": [a.token_ids for a in answers], "first_logprobs": first}, path)
    return answers


def paired(items: list[EvalItem], answers: dict[str, list[Answer]], against: list[str], dtype: str) -> list[dict]:
    """Per task: every mode minus each mode in `against`, on the same prompts, with the 95 % interval of the
    paired difference (the rows a claim like "re-alignment wins back N points" rests on)."""
    rows = []
    for base in against:
        if base not in answers:
            continue
        for spec, mode_list in answers.items():
            if spec == base:
                continue
            for task in sorted({item.task for item in items}):
                diffs = [int(score(a.text, item)) - int(score(b.text, item))
                         for item, a, b in zip(items, mode_list, answers[base]) if item.task == task]
                mean, low, high = paired_difference(diffs)
                rows.append({"bench": "fidelity_paired", "dtype": dtype, "task": task, "mode": spec, "against": base,
                             "num_prompts": len(diffs), "accuracy_diff_points": mean, "ci95_points": [low, high],
                             "num_changed": sum(d != 0 for d in diffs)})
    return rows


def compare(items: list[EvalItem], answers: dict[str, list[Answer]], other: Path, dtype: str) -> list[dict]:
    """Per task and mode present in both runs: accuracy here minus accuracy there on the same prompts, with
    a 95 % interval of the paired difference (each prompt is right or wrong in both runs)."""
    earlier: dict[str, list[dict]] = {}  # mode -> rows in item order (the eval set is built from a fixed seed)
    for line in other.read_text().splitlines():
        row = json.loads(line)
        earlier.setdefault(row["mode"], []).append(row)
    rows = []
    for spec, mode_answers_ in answers.items():
        before = earlier.get(spec)
        if before is None or len(before) != len(items):
            continue
        for task in sorted({item.task for item in items}):
            pairs = []
            for item, answer, then in zip(items, mode_answers_, before):
                assert then["meta"] == item.meta, "the runs must use the same eval set (--per-task, --seed)"
                if item.task == task:
                    pairs.append((score(answer.text, item), then["correct"]))
            diffs = [int(now) - int(then) for now, then in pairs]
            if not diffs:
                continue
            mean, low, high = paired_difference(diffs)
            rows.append({"bench": "fidelity_compare", "dtype": dtype, "against": other.name, "task": task,
                         "mode": spec, "num_prompts": len(diffs), "accuracy_diff_points": mean,
                         "ci95_points": [low, high],
                         "num_changed": sum(d != 0 for d in diffs)})
    return rows


if __name__ == "__main__":
    main()

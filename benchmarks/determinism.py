"""Determinism over HTTP: how often a greedy or seeded answer differs cold vs warm and alone vs in a batch of 16, per
numeric path, with and without `--deterministic`, and what `--deterministic` costs.

    python -m benchmarks.determinism [--prompts 200] [--max-tokens 12] [--paths fp32 bf16-torch bf16-kernel]
                                     [--threads N] [--timing-runs 7] [--variants default deterministic]
                                     [--skip-answers] [--skip-timing] [--out FILE]

Numeric paths (as tests/numeric_paths.py names them): `fp32`; `bf16-torch` (`--dtype bfloat16` with an empty kernel
folder: PyTorch's attention, what a CPU without our kernels runs); `bf16-kernel` (our AVX512-BF16 kernels, the default
bf16 path where the CPU has them; elsewhere recorded as not available on this CPU). Each path runs as served (default)
and with `--deterministic` (in bf16 both bf16 paths pair with the one deterministic bf16 server).

Answers: one `promptcache serve` of the default model per (path, variant). A schema of 10 documents is uploaded; the
prompts are half PML (1-2 imported documents and a question, varied) and half plain text (10 questions after each
document, so prompts share prefixes). Each prompt is answered greedily and seeded (temperature 0.9, n=3, seed 7),
`max_tokens` tokens, logprobs on, each mode under a cache salt of its own:
  cold     every prompt alone, the first time (a PML prompt's modules encoded at their first use under the salt, a
           plain prompt's document reused from the prompt before it; the rest computed);
  warm     every prompt alone again (an exact repeat: every token reused, the first logits cached);
  batched  every prompt again under a fresh salt, 16 concurrent requests at a time (modules re-encoded and prompts
           computed beside 15 others, chunked by the step budget).
Counted per mode: answers (a request's texts, all n samples) that differ cold vs warm and cold vs batched, and those
whose generated tokens' logprobs differ in any bit.

`--threads N` runs every server with N intra-op threads (OMP_NUM_THREADS; default: torch's own, one per core): on a
VM whose cores other work shares, one thread per server keeps OpenMP's barriers from waiting on descheduled threads.

Cost: the path's default and deterministic servers side by side, requests interleaved between them: TTFT of a cold
~600-token plain prompt (a fresh salt each), decode tokens/s of one stream (64 tokens, prompt cached) and of 16
concurrent streams (32 tokens each); medians of `timing_runs` rounds.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.evalset.data import make_documents
from benchmarks.harness import RESULTS, emit, log
from benchmarks.live_server import start_promptcache, stream_completion
from tests.numeric_paths import no_kernels_dir

PATHS = ("fp32", "bf16-torch", "bf16-kernel")
SYSTEM = "Answer the question with a short phrase, using only the documents."
QUESTIONS = ["Who is the mayor of {town}?", "What is the river in {town} called?",
             "In which year was {town} founded?", "What is the traditional dish of {town}?",
             "Describe {town} in one sentence.", "What is the first letter of the river in {town}?",
             "How old is {town} today, roughly?", "Name the mayor of {town} and the river there.",
             "Which dish would a visitor to {town} eat?", "Give the founding year of {town}, then its mayor."]
LEADS = ["", "Quick question: ", "Please answer briefly. ", "From the documents: ", "One more: "]
BATCH = 16


@dataclass(frozen=True)
class Mode:
    name: str
    body: dict  # sampling fields of the request


MODES = (Mode("greedy", {"temperature": 0}), Mode("seeded", {"temperature": 0.9, "n": 3, "seed": 7}))


def workload(num_prompts: int, seed: int = 0) -> tuple[str, list[str]]:
    """The schema and `num_prompts` prompts: PML ones (even indices) and plain ones sharing documents (odd)."""
    rng = random.Random(seed)
    documents = make_documents(10, seed)
    modules = "".join(f'<module name="{d.name}">{d.text}\n\n</module>' for d in documents)
    schema = f'<schema name="determinism"><system>{SYSTEM}</system><user>{modules}</user></schema>'
    pml, plain = [], []
    for i in range(num_prompts // 2 + 1):
        chosen = rng.sample(documents, rng.choice([1, 2]))
        question = rng.choice(LEADS) + QUESTIONS[i % len(QUESTIONS)].format(town=rng.choice(chosen).town)
        imports = "".join(f"<{d.name}/>" for d in chosen)
        pml.append(f'<prompt schema="determinism"><user>{imports}{question}</user><assistant/></prompt>')
        document = documents[(i // len(QUESTIONS)) % len(documents)]  # 10 questions after each document in turn
        question = LEADS[i % len(LEADS)] + QUESTIONS[i % len(QUESTIONS)].format(town=document.town)
        plain.append(f"{document.text}\n\nQuestion: {question}\nAnswer:")
    prompts = [p for pair in zip(pml, plain) for p in pair]
    return schema, prompts[:num_prompts]


def server_flags(path: str, deterministic: bool, weights: str = "auto") -> tuple[list[str], dict[str, str]]:
    """The serve flags and environment of a path's default or deterministic server; `weights` the default
    server's `--weights` (auto: int4 for the 4-bit built-in model; the deterministic server serves native ones)."""
    if path == "fp32":
        flags, env = ["--dtype", "float32"], {}
    elif deterministic:
        flags, env = ["--dtype", "bfloat16"], {}
    elif path == "bf16-torch":
        flags, env = ["--dtype", "bfloat16"], {"PROMPTCACHE_KERNEL_DIR": no_kernels_dir()}
    else:
        flags, env = ["--dtype", "bfloat16"], {}
    return [*flags, *(["--deterministic"] if deterministic else ["--weights", weights])], env


def available(path: str) -> str | None:
    """Why `path` cannot run on this CPU, or None."""
    if path != "bf16-kernel":
        return None
    from promptcache.model_runtime.attention import bf16_kernel

    return None if bf16_kernel.supported() else "not available on this CPU (it lacks AVX512-BF16)"


Answer = tuple[tuple[str, ...], tuple[tuple[float, ...], ...]]  # per sample: text; per sample: token logprobs


def complete(client: httpx.Client, url: str, prompt: str, mode: Mode, max_tokens: int, salt: str) -> Answer:
    body = {"prompt": prompt, "max_tokens": max_tokens, "logprobs": 1, "cache_salt": salt, **mode.body}
    response = client.post(url + "/v1/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return (tuple(c["text"] for c in choices),
            tuple(tuple(c["logprobs"]["token_logprobs"]) for c in choices))


def answers(url: str, prompts: list[str], mode: Mode, max_tokens: int) -> dict[str, list[Answer]]:
    """The mode's cold, warm and batched answers of every prompt (see the module docstring)."""
    found: dict[str, list[Answer]] = {}
    with httpx.Client(timeout=900) as client:
        for run, salt in (("cold", mode.name), ("warm", mode.name)):
            started = time.perf_counter()
            found[run] = [complete(client, url, p, mode, max_tokens, salt) for p in prompts]
            log(f"  {mode.name} {run}: {len(prompts)} requests in {time.perf_counter() - started:.0f} s")
        started = time.perf_counter()
        batched: list[Answer] = []
        with ThreadPoolExecutor(BATCH) as pool:
            for first in range(0, len(prompts), BATCH):
                group = prompts[first: first + BATCH]
                batched += pool.map(lambda p: complete(client, url, p, mode, max_tokens, f"{mode.name}-batch"), group)
        found["batched"] = batched
        log(f"  {mode.name} batched: {len(prompts)} requests in {time.perf_counter() - started:.0f} s")
    return found


def differences(a: list[Answer], b: list[Answer]) -> tuple[int, int]:
    """(answers whose texts differ, answers whose token logprobs differ in any bit)."""
    return sum(x[0] != y[0] for x, y in zip(a, b)), sum(x[1] != y[1] for x, y in zip(a, b))


def server_env(args, env: dict[str, str]) -> dict[str, str]:
    return {**env, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}


def measure_answers(args, path: str, deterministic: bool, schema: str, prompts: list[str], base: dict) -> list[dict]:
    flags, env = server_flags(path, deterministic, args.default_weights)
    env = server_env(args, env)
    log(f"{path} {'deterministic' if deterministic else 'default'}: serve {' '.join(flags)} {env or ''}")
    process, url = start_promptcache(flags, env=env)
    records = []
    try:
        httpx.post(url + "/v1/schemas", json={"pml": schema}, timeout=900).raise_for_status()
        for mode in MODES:
            found = answers(url, prompts, mode, args.max_tokens)
            warm_text, warm_bits = differences(found["cold"], found["warm"])
            batch_text, batch_bits = differences(found["cold"], found["batched"])
            record = {**base, "kind": "answers", "path": path, "deterministic": deterministic, "mode": mode.name,
                      "num_prompts": len(prompts), "samples_per_prompt": mode.body.get("n", 1),
                      "cold_vs_warm_differ": warm_text, "cold_vs_warm_logprobs_differ": warm_bits,
                      "alone_vs_batched_differ": batch_text, "alone_vs_batched_logprobs_differ": batch_bits,
                      "flags": flags, "env": env}
            emit(record, args.out)
            records.append(record)
            if args.answers_out is not None:
                with args.answers_out.open("a") as fh:
                    for i, prompt in enumerate(prompts):
                        fh.write(json.dumps({"path": path, "deterministic": deterministic, "mode": mode.name,
                                             "prompt": prompt, **{run: found[run][i][0] for run in found}}) + "\n")
    finally:
        process.terminate()
        process.wait(timeout=60)
    return records


def measure_cost(args, path: str, base: dict) -> dict:
    """TTFT and tokens/s of the path's default and deterministic servers, interleaved round by round."""
    documents = make_documents(3, 1)
    long_prompt = "\n\n".join(d.text for d in documents) + "\n\nQuestion: {q}\nAnswer:"
    servers = {}
    try:
        for deterministic in (False, True):
            flags, env = server_flags(path, deterministic, args.default_weights)
            servers[deterministic] = start_promptcache(flags, env=server_env(args, env))
        samples: dict[str, dict[bool, list[float]]] = {k: {False: [], True: []}
                                                      for k in ("ttft_ms", "tokens_per_s", "batch16_tokens_per_s")}
        with httpx.Client(timeout=900) as client:
            for _, url in servers.values():  # warm-up: prompts of the decode rows cached
                one_stream(client, url)
                sixteen_streams(url)
            for run in range(args.timing_runs):
                order = (False, True) if run % 2 == 0 else (True, False)
                for deterministic in order:
                    url = servers[deterministic][1]
                    body = {"prompt": long_prompt.format(q=f"How many towns are named? (run {run})"),
                            "max_tokens": 1, "temperature": 0, "cache_salt": f"ttft-{run}-{deterministic}"}
                    samples["ttft_ms"][deterministic].append(stream_completion(client, url + "/v1/completions",
                                                                               body).ttft_ms)
                    samples["tokens_per_s"][deterministic].append(one_stream(client, url))
                    samples["batch16_tokens_per_s"][deterministic].append(sixteen_streams(url))
                log(f"  cost round {run + 1}/{args.timing_runs}")
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
    record = {**base, "kind": "cost", "path": path, "timing_runs": args.timing_runs,
              "default_weights": args.default_weights}
    for metric, by_variant in samples.items():
        default, det = statistics.median(by_variant[False]), statistics.median(by_variant[True])
        record.update({f"{metric}_default": round(default, 2), f"{metric}_deterministic": round(det, 2),
                       f"{metric}_default_runs": [round(v, 2) for v in by_variant[False]],
                       f"{metric}_deterministic_runs": [round(v, 2) for v in by_variant[True]]})
        # a cost ratio > 1 is deterministic's slowdown: longer TTFT, fewer tokens per second
        record[f"{metric}_ratio"] = round(det / default if metric == "ttft_ms" else default / det, 3)
    emit(record, args.out)
    return record


def one_stream(client: httpx.Client, url: str) -> float:
    """Decode tokens/s of one request of 64 tokens whose prompt is cached (sent once before: no prefill)."""
    body = {"prompt": "Write a short story about a lighthouse keeper.", "max_tokens": 64, "temperature": 0,
            "ignore_eos": True}
    started = time.perf_counter()
    response = client.post(url + "/v1/completions", json=body)
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"] / (time.perf_counter() - started)


def sixteen_streams(url: str) -> float:
    """Aggregate decode tokens/s of 16 concurrent requests of 32 tokens (their prompts cached after the first run)."""
    bodies = [{"prompt": f"Write a short story about a lighthouse keeper named {name}.", "max_tokens": 32,
               "temperature": 0, "ignore_eos": True} for name in ("Ann", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Hal",
                                                                    "Ivy", "Jo", "Kit", "Lu", "Mo", "Ned", "Oz", "Pia")]
    with httpx.Client(timeout=900) as client, ThreadPoolExecutor(BATCH) as pool:
        started = time.perf_counter()
        responses = list(pool.map(lambda b: client.post(url + "/v1/completions", json=b), bodies))
        elapsed = time.perf_counter() - started
    for response in responses:
        response.raise_for_status()
    return sum(r.json()["usage"]["completion_tokens"] for r in responses) / elapsed


def machine() -> dict:
    info = {"machine": platform.machine(), "cpu": platform.processor()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
        info["cpus"] = text.count("processor\t:")
        flags = next(line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags"))
        info["cpu_flags"] = sorted(f for f in flags if f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"))
    except (OSError, StopIteration):
        pass
    return info


def plot(records: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    answers_rows = [r for r in records if r["kind"] == "answers"]
    costs = [r for r in records if r["kind"] == "cost"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    labels = [f"{r['path']}\n{'det' if r['deterministic'] else 'default'}\n{r['mode']}" for r in answers_rows]
    x = range(len(answers_rows))
    left.bar([i - 0.2 for i in x], [r["cold_vs_warm_differ"] for r in answers_rows], 0.4, label="cold vs warm")
    left.bar([i + 0.2 for i in x], [r["alone_vs_batched_differ"] for r in answers_rows], 0.4,
             label=f"alone vs batch of {BATCH}")
    left.set_xticks(list(x), labels, fontsize=7)
    left.set_ylabel(f"answers that differ (of {answers_rows[0]['num_prompts'] if answers_rows else 0})")
    left.legend()
    metrics = ("ttft_ms", "tokens_per_s", "batch16_tokens_per_s")
    for j, cost in enumerate(costs):
        right.bar([m + j * 0.8 / max(1, len(costs)) for m in range(len(metrics))],
                  [cost[f"{metric}_ratio"] for metric in metrics], 0.8 / max(1, len(costs)), label=cost["path"])
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_xticks(range(len(metrics)), ["TTFT", "tokens/s (1)", f"tokens/s ({BATCH})"])
    right.set_ylabel("deterministic cost (x default)")
    right.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    log(f"plot: {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads of every server (default: "
                        "torch's, one per core)")
    parser.add_argument("--timing-runs", type=int, default=7)
    parser.add_argument("--variants", nargs="+", choices=("default", "deterministic"),
                        default=["default", "deterministic"], help="which servers answer (default: both)")
    parser.add_argument("--default-weights", choices=("auto", "native", "int8", "int4"), default="auto",
                        help="the default server's --weights (default: auto, as served)")
    parser.add_argument("--skip-answers", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "determinism.jsonl")
    parser.add_argument("--answers-out", type=Path, default=None, help="also write every prompt's answers here")
    args = parser.parse_args()
    base = {"benchmark": "determinism", **machine(), "max_tokens": args.max_tokens, "server_threads": args.threads}
    schema, prompts = workload(args.prompts)
    records: list[dict] = []
    deterministic_bf16: list[dict] | None = None
    for path in args.paths:
        if (why := available(path)) is not None:
            emit({**base, "kind": "unavailable", "path": path, "reason": why}, args.out)
            continue
        if not args.skip_answers:
            if "default" in args.variants:
                records += measure_answers(args, path, False, schema, prompts, base)
            wanted = "deterministic" in args.variants
            if wanted and path == "fp32":
                records += measure_answers(args, path, True, schema, prompts, base)
            elif wanted and deterministic_bf16 is None:  # one deterministic bf16 server serves both bf16 paths' rows
                deterministic_bf16 = measure_answers(args, path, True, schema, prompts, base)
                records += deterministic_bf16
        if not args.skip_timing:
            records.append(measure_cost(args, path, base))
    if records:  # every record in the file: an answers run and a timing run made apart are drawn together
        plot(latest(args.out), args.out.with_suffix(".png"))


def latest(out: Path) -> list[dict]:
    """The file's records, the last of each (kind, path, variant, mode) kept, in first-seen order."""
    found: dict[tuple, dict] = {}
    for line in out.read_text().splitlines():
        record = json.loads(line)
        found[(record["kind"], record["path"], record.get("deterministic"), record.get("mode"))] = record
    return list(found.values())


if __name__ == "__main__":
    main()

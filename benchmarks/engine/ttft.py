"""TTFT: HF full prefill (no cache) vs promptcache (modules cached), same model, same prompt.

    python -m benchmarks.engine.ttft --shapes tinyllama-1.1b qwen2.5-0.5b --lengths 1024 2048 4096

Random-weight models of realistic shapes (fp32), the real SmolLM2 tokenizer for the text, prompts of
`length` tokens of which ~64 are new (a question in the documents' user turn). The baseline is one
forward pass over the whole prompt with `logits_to_keep=1` (HF's cheapest full prefill); the cached
path assembles the module KV and computes only the new tokens. Both pick the greedy first token,
which must be equal (the prompt is served exactly). Prints JSON lines; draws a PNG.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoTokenizer

from benchmarks.engine.engine_timer import EngineTimer
from benchmarks.harness import RESULTS, emit, log, median_ms, setup
from benchmarks.shapes import build_model
from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, wrap_model
from promptcache.model_runtime.loading.default_model import default_model_path

PROSE = ("The committee met on a grey morning to review the harbour plans. Engineers described the new "
         "breakwater, the dredging schedule and the cost of steel. A fisherman asked whether the boats "
         "would still reach the old quay at low tide, and the chair promised a survey before winter. ")


QUESTION = ("Considering everything recorded in the minutes above, what exactly did the chair promise the "
            "fisherman about reaching the old quay at low tide, which engineers spoke about the breakwater and the "
            "dredging schedule, and when will the survey of the harbour be completed?")


def document(tokenizer, num_tokens: int) -> str:
    ids = tokenizer.encode(PROSE * (num_tokens // 40 + 2), add_special_tokens=False)[:num_tokens]
    return tokenizer.decode(ids)


def schema_and_prompt(document: str, question: str) -> tuple[str, str]:
    escape = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;"})
    schema = (f'<schema name="minutes"><system>You answer questions about meeting minutes.</system>'
              f'<user><module name="minutes" xml:space="preserve">{document.translate(escape)}</module>'
              '</user></schema>')
    prompt = f'<prompt schema="minutes"><user><minutes/>{question.translate(escape)}</user><assistant/></prompt>'
    return schema, prompt


def run(shape: str, lengths: list[int], runs: int, out: Path) -> list[dict]:
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())  # the real SmolLM2 tokenizer
    model = build_model(shape, min_vocab=len(tokenizer))
    loaded = wrap_model(model, tokenizer, name=shape)
    records = []
    for length in lengths:
        runtime = ModelRuntime(loaded, build_store(StoreConfig(device_max_bytes=8 << 30), device="cpu"))
        # Size the document so that the whole prompt is `length` tokens (markup and question included).
        doc_tokens = length
        for _ in range(3):
            schema_text, prompt_text = schema_and_prompt(document(tokenizer, doc_tokens), QUESTION)
            schema = runtime.parse_schema(schema_text)
            runtime.add_schema(schema, encode=False)
            total = runtime.plan(prompt_text).num_prompt_tokens
            doc_tokens += length - total
        report = runtime.add_schema(schema)
        plan = runtime.plan(prompt_text)
        ids = torch.tensor([plan.token_ids()])                 # [1, n]
        positions = torch.tensor([plan.position_ids()])        # [1, n]

        def baseline(model=model, ids=ids, positions=positions) -> int:
            with torch.inference_mode():
                out = model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids),
                            logits_to_keep=1, use_cache=True)
            return int(out.logits[0, -1].argmax())

        timer = EngineTimer(runtime)  # module caching only: no prefix reuse of the repeated question

        def cached(timer=timer, plan=plan) -> int:
            return timer.first_token(plan)[0]

        log(f"{shape} {plan.num_prompt_tokens} tokens: timing baseline")
        base_ms, base_all = median_ms(baseline, runs=runs)
        log(f"{shape} {plan.num_prompt_tokens} tokens: timing cached (through the engine)")
        cached_ms, cached_all = median_ms(cached, runs=runs)
        shares = [timer.first_token(plan)[2].report.timings for _ in range(3)]
        assembly_ms = sorted(s.assembly_ms for s in shares)[1]
        record = {
            "bench": "ttft", "shape": shape, "dtype": "float32", "vocab": model.config.vocab_size,
            "prompt_tokens": plan.num_prompt_tokens,
            "new_tokens": plan.num_new_tokens, "cached_tokens": plan.num_cached_tokens, "exact": plan.is_exact,
            "baseline_ms": round(base_ms, 2), "cached_ms": round(cached_ms, 2),
            "ratio": round(base_ms / cached_ms, 2), "assembly_ms": round(assembly_ms, 2),
            "assembly_share": round(assembly_ms / cached_ms, 4), "encode_ms": round(report.encode_ms, 1),
            "first_token_equal": baseline() == cached(), "runs": runs,
            "baseline_runs_ms": [round(t, 1) for t in base_all], "cached_runs_ms": [round(t, 1) for t in cached_all],
        }
        timer.close()
        emit(record, out)
        records.append(record)
    return records


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for shape in sorted({r["shape"] for r in records}):
        rows = [r for r in records if r["shape"] == shape]
        xs = [r["prompt_tokens"] for r in rows]
        ax.plot(xs, [r["baseline_ms"] for r in rows], "o--", label=f"{shape} HF full prefill")
        ax.plot(xs, [r["cached_ms"] for r in rows], "o-", label=f"{shape} promptcache")
        for r in rows:
            ax.annotate(f'{r["ratio"]:.0f}x', (r["prompt_tokens"], r["cached_ms"]), textcoords="offset points",
                        xytext=(0, -12), ha="center", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (~64 new)")
    ax.set_ylabel("TTFT (ms, median)")
    ax.set_title(f"Time to first token, CPU, {torch.get_num_threads()} threads, fp32")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["tinyllama-1.1b", "qwen2.5-0.5b"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "ttft.jsonl")
    args = parser.parse_args()
    setup(args.threads)
    records = []
    for shape in args.shapes:
        records += run(shape, args.lengths, args.runs, args.out)
    plot(records, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()

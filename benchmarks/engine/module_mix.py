"""Module-combination workload: k of M documents in random order + a question.

    python -m benchmarks.engine.module_mix --shape qwen2.5-0.5b --docs 20 --pick 8 --prompts 12 \\
        [--dtypes float32 bfloat16]

Compares, on the same prompts and model:
- no_cache: full prefill of every prompt;
- prefix_cache: reuse of the longest token prefix seen in an earlier prompt (what vLLM / SGLang
  automatic prefix caching reuses), the rest computed;
- module_cache: promptcache (documents are schema modules encoded once; only the question is computed).
Reports median TTFT and the fraction of prompt tokens served from cache. JSON lines + PNG. Weights are
prepacked as the server does; with several `--dtypes`, every prompt runs on each model in turn and each
row gives its ratio to the first dtype (`vs_first_dtype`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, DynamicCache

from benchmarks.engine.engine_timer import EngineTimer
from benchmarks.harness import RESULTS, emit, log, setup
from benchmarks.shapes import build_model
from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, wrap_model
from promptcache.model_runtime.loading.default_model import default_model_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

TOPICS = ["harbour", "orchard", "library", "observatory", "railway", "bakery", "glacier", "vineyard", "museum",
          "lighthouse", "market", "monastery", "canal", "quarry", "theatre", "forest", "bridge", "mill", "island",
          "desert", "volcano", "reef", "castle", "valley"]


def document(index: int, tokenizer, num_tokens: int) -> str:
    topic = TOPICS[index % len(TOPICS)]
    sentence = (f"Report {index} concerns the {topic}. Its keeper, named Keeper{index}, counted {index * 37 + 11} "
                f"visitors last season and asked the council for {index + 3} new benches near the {topic}. ")
    ids = tokenizer.encode(sentence * (num_tokens // 20 + 2), add_special_tokens=False)[:num_tokens]
    return tokenizer.decode(ids).replace("&", "and").replace("<", " ").replace(">", " ")


class PrefixCache:
    """Exact-prefix KV reuse: keeps every earlier prompt's KV; reuses the longest common token prefix."""

    def __init__(self, model) -> None:
        self.model = model
        self.entries: list[tuple[list[int], DynamicCache]] = []

    def ttft(self, token_ids: list[int]) -> tuple[int, int]:
        best, best_len = None, 0
        for ids, cache in self.entries:
            n = 0
            for a, b in zip(ids, token_ids):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = cache, n
        best_len = min(best_len, len(token_ids) - 1)  # at least one token is computed
        cache = DynamicCache()
        if best is not None and best_len > 0:
            for layer_idx, layer in enumerate(best.layers):
                cache.update(layer.keys[:, :, :best_len].clone(), layer.values[:, :, :best_len].clone(), layer_idx)
        rest = torch.tensor([token_ids[best_len:]])  # [1, n - reused]
        mask = torch.ones((1, len(token_ids)), dtype=torch.long)  # [1, n]
        with torch.inference_mode():
            out = self.model(input_ids=rest, attention_mask=mask, past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
        self.entries.append((token_ids, out.past_key_values))
        return int(out.logits[0, -1].argmax()), best_len


@dataclass
class Setup:
    """One dtype's model, as the server would run it (packed weights), and its three ways to answer."""

    dtype: str
    model: torch.nn.Module
    runtime: ModelRuntime
    prefix_cache: PrefixCache
    timer: EngineTimer


def build_setup(shape: str, dtype: str, tokenizer, docs: list[str], system: str) -> Setup:
    model = build_model(shape, min_vocab=len(tokenizer), dtype=DTYPES[dtype])
    runtime = ModelRuntime(wrap_model(model, tokenizer, name=shape, pack_weights=True, fuse_layers=True),
                           build_store(StoreConfig(device_max_bytes=8 << 30), device="cpu"))
    modules = "".join(f'<module name="doc{i}">{text}</module>' for i, text in enumerate(docs))
    report = runtime.add_schema(runtime.parse_schema(
        f'<schema name="reports"><system>{system}</system><user>{modules}</user></schema>'))
    log(f"{dtype}: encoded {report.num_segments} segments in {report.encode_ms:.0f} ms")
    return Setup(dtype, model, runtime, PrefixCache(model), EngineTimer(runtime))  # module caching alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32"],
                        help="several: each prompt runs on each in turn (drift hits all alike)")
    parser.add_argument("--docs", type=int, default=20)
    parser.add_argument("--doc-tokens", type=int, default=200)
    parser.add_argument("--pick", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "module_mix.jsonl")
    args = parser.parse_args()
    setup(args.threads)
    rng = random.Random(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    docs = [document(i, tokenizer, args.doc_tokens) for i in range(args.docs)]
    system = "You answer questions about the council reports below."
    setups = [build_setup(args.shape, dtype, tokenizer, docs, system) for dtype in args.dtypes]
    fmt = setups[0].runtime.text_encoder.chat_format
    samples = {s.dtype: {"no_cache": [], "prefix_cache": [], "module_cache": []} for s in setups}
    served: dict[str, list[int]] = {"prefix_cache": [], "module_cache": []}
    total_tokens: list[int] = []
    for index in range(args.warmup + args.prompts):
        picked = rng.sample(range(args.docs), args.pick)
        question = f"Which keeper asked for the most benches, and how many visitors did report {picked[0]} count?"
        prompt = (f'<prompt schema="reports"><user>{"".join(f"<doc{i}/>" for i in picked)}'
                  f'{question}</user><assistant/></prompt>')
        # What a prefix cache sees: the same documents, in the prompt's order, as one chat.
        text = (fmt.prefixes["system"] + system + fmt.suffixes["system"] + fmt.prefixes["user"]
                + "".join(docs[i] for i in picked) + question + fmt.suffixes["user"] + fmt.generation_prompt)
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        for s in setups:
            plan = s.runtime.plan(prompt)
            started = time.perf_counter()
            with torch.inference_mode():
                s.model(input_ids=torch.tensor([token_ids]), logits_to_keep=1,
                        attention_mask=torch.ones((1, len(token_ids)), dtype=torch.long)).logits[0, -1].argmax()
            no_cache_ms = (time.perf_counter() - started) * 1e3
            started = time.perf_counter()
            _, reused = s.prefix_cache.ttft(token_ids)
            prefix_ms = (time.perf_counter() - started) * 1e3
            started = time.perf_counter()
            s.timer.first_token(plan)
            module_ms = (time.perf_counter() - started) * 1e3
            log(f"prompt {index} {s.dtype}: no_cache {no_cache_ms:.0f} ms, prefix {prefix_ms:.0f} ms "
                f"(reused {reused}), module {module_ms:.0f} ms")
            if index < args.warmup:
                continue
            for mode, ms in (("no_cache", no_cache_ms), ("prefix_cache", prefix_ms), ("module_cache", module_ms)):
                samples[s.dtype][mode].append(ms)
            if s is setups[0]:
                served["prefix_cache"].append(reused)
                served["module_cache"].append(plan.num_cached_tokens)
                total_tokens.append(len(token_ids))

    medians = {dtype: {mode: statistics.median(v) for mode, v in modes.items()} for dtype, modes in samples.items()}
    for dtype, by_mode in medians.items():
        for mode in by_mode:
            cached = sum(served.get(mode, [0])) / sum(total_tokens)
            emit({"bench": "module_mix", "shape": args.shape, "dtype": dtype, "mode": mode, "docs": args.docs,
                  "pick": args.pick, "doc_tokens": args.doc_tokens, "prompts": args.prompts,
                  "median_ttft_ms": round(by_mode[mode], 2), "runs_ms": [round(x, 1) for x in samples[dtype][mode]],
                  "cached_fraction": round(cached, 4), "mean_prompt_tokens": round(statistics.mean(total_tokens), 1),
                  "speedup_vs_no_cache": round(by_mode["no_cache"] / by_mode[mode], 2),
                  "speedup_vs_prefix_cache": round(by_mode["prefix_cache"] / by_mode[mode], 2),
                  "vs_first_dtype": round(medians[args.dtypes[0]][mode] / by_mode[mode], 2)}, args.out)
    plot(medians, served, total_tokens, args.out.with_suffix(".png"), args.shape)


def plot(medians, served, total_tokens, path: Path, shape: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(medians)
    modes = list(medians[dtypes[0]])
    width = 0.8 / len(dtypes)
    fig, ax = plt.subplots(figsize=(6 + len(dtypes), 3.5))
    for d, dtype in enumerate(dtypes):
        xs = [m + d * width for m in range(len(modes))]
        bars = ax.bar(xs, [medians[dtype][m] for m in modes], width, label=dtype)
        for bar, mode in zip(bars, modes):
            fraction = sum(served.get(mode, [0])) / sum(total_tokens)
            ax.annotate(f"{medians[dtype][mode]:.0f} ms\n{fraction:.0%} cached",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks([m + width * (len(dtypes) - 1) / 2 for m in range(len(modes))], modes)
    ax.set_ylabel("median TTFT (ms)")
    ax.set_title(f"k of M documents in random order ({shape}, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

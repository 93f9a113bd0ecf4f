"""Module-combination workload: k of M documents in random order + a question.

    python benchmarks/module_mix.py --shape qwen2.5-0.5b --docs 20 --pick 8 --prompts 12

Compares, on the same prompts and model:
- no_cache: full prefill of every prompt;
- prefix_cache: reuse of the longest token prefix seen in an earlier prompt (what vLLM / SGLang
  automatic prefix caching reuses), the rest computed;
- module_cache: promptcache (documents are schema modules encoded once; only the question is computed).
Reports median TTFT and the fraction of prompt tokens served from cache. JSON lines + PNG.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, DynamicCache

from benchmarks.engine_timer import EngineTimer
from benchmarks.harness import RESULTS, emit, log, setup
from benchmarks.shapes import build_model
from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, wrap_model
from promptcache.model_runtime.default_model import default_model_path

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b")
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
    model = build_model(args.shape, min_vocab=len(tokenizer))
    runtime = ModelRuntime(wrap_model(model, tokenizer, name=args.shape),
                           build_store(StoreConfig(device_max_bytes=8 << 30), device="cpu"))
    docs = [document(i, tokenizer, args.doc_tokens) for i in range(args.docs)]
    system = "You answer questions about the council reports below."
    modules = "".join(f'<module name="doc{i}">{text}</module>' for i, text in enumerate(docs))
    report = runtime.add_schema(runtime.parse_schema(
        f'<schema name="reports"><system>{system}</system><user>{modules}</user></schema>'))
    log(f"encoded {report.num_segments} segments in {report.encode_ms:.0f} ms")
    fmt = runtime.text_encoder.chat_format
    prefix_cache = PrefixCache(model)
    timer = EngineTimer(runtime)  # module caching alone, through the engine
    samples: dict[str, list[float]] = {"no_cache": [], "prefix_cache": [], "module_cache": []}
    served: dict[str, list[int]] = {"prefix_cache": [], "module_cache": []}
    total_tokens: list[int] = []
    for index in range(args.warmup + args.prompts):
        picked = rng.sample(range(args.docs), args.pick)
        question = f"Which keeper asked for the most benches, and how many visitors did report {picked[0]} count?"
        plan = runtime.plan(f'<prompt schema="reports"><user>{"".join(f"<doc{i}/>" for i in picked)}'
                            f'{question}</user><assistant/></prompt>')
        # What a prefix cache sees: the same documents, in the prompt's order, as one chat.
        text = (fmt.prefixes["system"] + system + fmt.suffixes["system"] + fmt.prefixes["user"]
                + "".join(docs[i] for i in picked) + question + fmt.suffixes["user"] + fmt.generation_prompt)
        token_ids = tokenizer.encode(text, add_special_tokens=False)

        started = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=torch.tensor([token_ids]), attention_mask=torch.ones((1, len(token_ids)), dtype=torch.long),
                  logits_to_keep=1).logits[0, -1].argmax()
        no_cache_ms = (time.perf_counter() - started) * 1e3
        started = time.perf_counter()
        _, reused = prefix_cache.ttft(token_ids)
        prefix_ms = (time.perf_counter() - started) * 1e3
        started = time.perf_counter()
        timer.first_token(plan)
        module_ms = (time.perf_counter() - started) * 1e3
        log(f"prompt {index}: no_cache {no_cache_ms:.0f} ms, prefix {prefix_ms:.0f} ms (reused {reused}), "
            f"module {module_ms:.0f} ms")
        if index < args.warmup:
            continue
        samples["no_cache"].append(no_cache_ms)
        samples["prefix_cache"].append(prefix_ms)
        samples["module_cache"].append(module_ms)
        served["prefix_cache"].append(reused)
        served["module_cache"].append(plan.num_cached_tokens)
        total_tokens.append(len(token_ids))

    medians = {mode: statistics.median(values) for mode, values in samples.items()}
    for mode in samples:
        cached = sum(served.get(mode, [0])) / sum(total_tokens)
        emit({"bench": "module_mix", "shape": args.shape, "mode": mode, "docs": args.docs, "pick": args.pick,
              "doc_tokens": args.doc_tokens, "prompts": args.prompts, "median_ttft_ms": round(medians[mode], 2),
              "cached_fraction": round(cached, 4), "mean_prompt_tokens": round(statistics.mean(total_tokens), 1),
              "speedup_vs_no_cache": round(medians["no_cache"] / medians[mode], 2),
              "speedup_vs_prefix_cache": round(medians["prefix_cache"] / medians[mode], 2)}, args.out)
    plot(medians, served, total_tokens, args.out.with_suffix(".png"), args.shape)


def plot(medians, served, total_tokens, path: Path, shape: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(medians)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar(modes, [medians[m] for m in modes], color=["#999", "#69c", "#c63"])
    for bar, mode in zip(bars, modes):
        fraction = sum(served.get(mode, [0])) / sum(total_tokens)
        ax.annotate(f"{medians[mode]:.0f} ms\n{fraction:.0%} cached", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("median TTFT (ms)")
    ax.set_title(f"k of M documents in random order ({shape}, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

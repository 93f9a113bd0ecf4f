"""Memory under automatic prefix reuse: 1,000 distinct 2K-token prompts against small tier budgets.

    python -m benchmarks.prefix_memory [--prompts 1000 --tokens 2048]

A real `promptcache serve` over a small random-weight Llama (SmolLM2's tokenizer; KV 2 KiB/token, so
1,000 prompts would store ~4 GB of prefix blocks without eviction) with a 64 MiB device tier and a
128 MiB host tier. Every prompt is new (a distinct opening line), sent over HTTP. Every 100 prompts the
server's resident memory (psutil) and its tiers' bytes (/metrics) are recorded; the run passes when
every tier stays within its budget and RSS growth stays within the budgets plus a fixed margin.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

import httpx
import psutil
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from benchmarks.harness import RESULTS, emit, log
from benchmarks.live_server import start_promptcache
from benchmarks.serving_workloads import build
from promptcache.model_runtime.loading.default_model import default_model_path

DEVICE_BUDGET, HOST_BUDGET = 64 << 20, 128 << 20
MARGIN = 256 << 20  # allocator slack, request buffers, Python objects


def small_model(directory: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def tier_bytes(url: str) -> dict[str, int]:
    text = httpx.get(url + "/metrics").text
    return {m.group(1): int(float(m.group(2))) for m in
            re.finditer(r'^promptcache:cache_usage_bytes\{tier="(\w+)"\} (\S+)$', text, re.M)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=RESULTS / "prefix_memory.jsonl")
    args = parser.parse_args()
    document = build().document
    with tempfile.TemporaryDirectory() as tmp:
        small_model(Path(tmp))
        process, url = start_promptcache(["--model", tmp, "--prefix-block-size", "32"], env={
            "PROMPTCACHE_DEVICE_MAX_BYTES": str(DEVICE_BUDGET), "PROMPTCACHE_HOST_MAX_BYTES": str(HOST_BUDGET)})
        try:
            server = psutil.Process(process.pid)
            client = httpx.Client(timeout=120)
            client.post(url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 1}).raise_for_status()
            base_rss = server.memory_info().rss
            peak_rss, worst = base_rss, {"device": 0, "host": 0}
            cached = 0
            for i in range(args.prompts):
                body = {"prompt": f"Prompt {i}: a distinct opening line.\n\n{document}", "max_tokens": 4}
                reply = client.post(url + "/v1/completions", json=body)
                reply.raise_for_status()
                cached += reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                if (i + 1) % 100 == 0:
                    used = tier_bytes(url)
                    worst = {t: max(worst[t], used.get(t, 0)) for t in worst}
                    peak_rss = max(peak_rss, server.memory_info().rss)
                    log(f"{i + 1} prompts: tiers {used}, rss {server.memory_info().rss >> 20} MiB")
            prompt_tokens = reply.json()["usage"]["prompt_tokens"]
        finally:
            process.terminate()
            process.wait(timeout=30)
    growth = peak_rss - base_rss
    emit({"bench": "prefix_memory", "prompts": args.prompts, "prompt_tokens": prompt_tokens,
          "kv_bytes_without_eviction": args.prompts * prompt_tokens * 2 * 2 * 64 * 2 * 4,
          "device_budget": DEVICE_BUDGET, "host_budget": HOST_BUDGET, "device_peak": worst["device"],
          "host_peak": worst["host"], "rss_base": base_rss, "rss_peak": peak_rss, "rss_growth": growth,
          "cached_tokens_total": cached,
          "within_budgets": worst["device"] <= DEVICE_BUDGET and worst["host"] <= HOST_BUDGET
          and growth <= DEVICE_BUDGET + HOST_BUDGET + MARGIN}, args.out)


if __name__ == "__main__":
    main()

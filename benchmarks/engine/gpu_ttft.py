"""TTFT on a GPU: HF full prefill vs promptcache with the prompt's modules cached, same model, same prompt.

    python -m benchmarks.engine.gpu_ttft --device cuda                 # ~1B Llama shape, bf16, 4K-token prompt
    python -m benchmarks.engine.gpu_ttft --device cpu --smoke          # tiny, to check the script

The TinyLlama-1.1B shape (benchmarks/shapes.py) with random weights made directly on the device (no
download, no checkpoint), a byte tokenizer built in process (shapes.py), and ttft.py's
prompt: a document module filling `length` tokens with a question of about 55 new tokens. Baseline: one
forward pass over the whole prompt with `logits_to_keep=1`; cached: the engine assembles the module KV
(already encoded: `encode_ms` reports that cold encode) and computes only the new tokens. Both read
their greedy first token back (the host waits for the GPU). The cached path runs twice, with CUDA graphs (the
server's default: the new tokens are a lone prefill, replayed from a graph) and without; beside each wall time
(submit to first token, measured here) stand the engine's own `ttft_ms` and `prefill_ms` as its final event reports
them (the server's response `timings`), so engine and event-loop overhead is told apart from the passes. Prints
JSON lines.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks.engine.engine_timer import EngineTimer
from benchmarks.engine.ttft import document, schema_and_prompt
from benchmarks.harness import device_name, emit, gpu_parser, log, median_ms
from benchmarks.shapes import SHAPES, byte_tokenizer
from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime, wrap_model

SHAPE = "tinyllama-1.1b"
# About 55 new tokens under the byte tokenizer: the question's bytes plus the closing and generation markup.
QUESTION = "What did the chair promise about the quay?"


def build(device: torch.device, dtype: torch.dtype, smoke: bool):
    """The random-weight model, made on `device` (weights never touch the host): the Hugging Face model
    for the baseline, and a copy loaded as the server loads it (fused layers) for the engine."""
    tokenizer = byte_tokenizer()
    if smoke:
        config = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    else:
        config = SHAPES[SHAPE](32000)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    loaded = wrap_model(copy.deepcopy(model).eval(), tokenizer, name=SHAPE if not smoke else "tiny-llama",
                        fuse_layers=True)
    return model.eval(), loaded


def run(device: torch.device, dtype: torch.dtype, length: int, runs: int, smoke: bool, out: Path) -> dict:
    model, loaded = build(device, dtype, smoke)
    tokenizer = loaded.tokenizer
    runtime = ModelRuntime(loaded, build_store(StoreConfig(device_max_bytes=8 << 30), device=str(device)))
    doc_tokens = length  # size the document so that the whole prompt is `length` tokens
    for _ in range(3):
        schema_text, prompt_text = schema_and_prompt(document(tokenizer, doc_tokens), QUESTION)
        schema = runtime.parse_schema(schema_text)
        runtime.add_schema(schema, encode=False)
        doc_tokens += length - runtime.plan(prompt_text).num_prompt_tokens
    report = runtime.add_schema(schema)
    plan = runtime.plan(prompt_text)
    ids = torch.tensor([plan.token_ids()], device=device)            # [1, n]
    positions = torch.tensor([plan.position_ids()], device=device)   # [1, n]

    def baseline() -> int:
        with torch.inference_mode():
            logits = model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids),
                           logits_to_keep=1, use_cache=True).logits
        return int(logits[0, -1].argmax())

    log(f"{plan.num_prompt_tokens} tokens: timing HF full prefill")
    base_ms, base_all = median_ms(baseline, runs=runs, warmup=2)
    cached_rows, first_tokens = {}, {}
    for label, graphs in (("cached", True), ("cached_eager", False)):
        log(f"{plan.num_prompt_tokens} tokens: timing cached modules (through the engine, CUDA graphs {graphs})")
        cached_rows[label], first_tokens[label] = _engine_ttft(runtime, plan, runs, cuda_graphs=graphs)
    same_token = baseline() == first_tokens["cached"]
    cached_ms, cached_all = cached_rows["cached"].pop("wall_ms"), cached_rows["cached"].pop("wall_runs_ms")
    record = {
        "bench": "gpu_ttft", "shape": SHAPE if not smoke else "tiny-llama", "device": device_name(device),
        "dtype": str(dtype)[6:], "prompt_tokens": plan.num_prompt_tokens, "new_tokens": plan.num_new_tokens,
        "cached_tokens": plan.num_cached_tokens, "baseline_ms": round(base_ms, 2), "cached_ms": round(cached_ms, 2),
        "ratio": round(base_ms / cached_ms, 2), "encode_ms": round(report.encode_ms, 1),
        **{f"cached_{name}": value for name, value in cached_rows["cached"].items()},  # the engine's own, graphs on
        **{f"cached_eager_{name}": value for name, value in cached_rows["cached_eager"].items()},
        "eager_ratio": round(base_ms / cached_rows["cached_eager"]["wall_ms"], 2),
        # bf16 random weights leave near-ties among 32000 logits: a differing argmax is reported, not an error
        "first_token_equal": same_token, "runs": runs,
        "baseline_runs_ms": [round(t, 2) for t in base_all], "cached_runs_ms": [round(t, 2) for t in cached_all]}
    emit(record, out)
    return record


def _engine_ttft(runtime: ModelRuntime, plan, runs: int, *, cuda_graphs: bool) -> tuple[dict, int]:
    """Median wall ms (submit to first token, here) and the engine's own median `ttft_ms`, `prefill_ms` and
    `assembly_ms` (its final event's timings) over `runs` requests after 2 warm-ups; and the greedy first token."""
    timer = EngineTimer(runtime, cuda_graphs=cuda_graphs)  # module caching only: no prefix reuse of the question
    reports: list = []

    def cached() -> int:
        token, _, final = timer.first_token(plan)
        reports.append(final.report.timings)
        return token

    try:
        wall_ms, wall_all = median_ms(cached, runs=runs, warmup=2)
        token = cached()
    finally:
        timer.close()
    timed = reports[2:-1]  # the timed runs' own timings

    def median(name: str) -> float:
        values = sorted(getattr(t, name) for t in timed)
        return round(values[len(values) // 2], 2)

    return ({"wall_ms": round(wall_ms, 2), "wall_runs_ms": [round(t, 2) for t in wall_all],
             "engine_ttft_ms": median("ttft_ms"), "engine_prefill_ms": median("prefill_ms"),
             "engine_assembly_ms": median("assembly_ms")}, token)


def main() -> None:
    parser = gpu_parser(__doc__, "ttft.jsonl", "a tiny model and prompt (checks the script)")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    if args.smoke:
        args.length, args.runs = 256, 2
    record = run(torch.device(args.device), getattr(torch, args.dtype), args.length, args.runs, args.smoke, args.out)
    log(f"TTFT {record['prompt_tokens']} tokens: HF {record['baseline_ms']} ms, cached {record['cached_ms']} ms "
        f"({record['ratio']}x; engine ttft {record['cached_engine_ttft_ms']} ms, prefill "
        f"{record['cached_engine_prefill_ms']} ms), eager {record['cached_eager_wall_ms']} ms")


if __name__ == "__main__":
    main()

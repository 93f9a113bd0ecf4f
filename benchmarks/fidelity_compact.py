"""Where should a module's second encoding sit? An in-process emulation on the evaluation's prompts,
Hugging Face's model only (no promptcache engine on the path), to choose before building.

    python -m benchmarks.fidelity_compact --limit 100 --reference-cache /tmp/depth_refs_seed0.pt \
        --variants predecessor@layout predecessor@compact actual@compact balanced:16/predecessor@compact

A variant is "[balanced:k/]rule@placement". Every prompt is served as `fast` (or `balanced` with k head
tokens) at contiguous positions: each cached segment's KV is computed in its encoding context, in one
pass over the context's tokens and the segment's, then placed at the segment's position in the prompt
(RoPE sees only relative positions: the pass is run at positions shifted so the segment lands there).
- rule: the encoding context of a segment that is not in context (a segment in context keeps its
  schema context): `schema` (what the schema guarantees precedes it), `predecessor` (that and the
  module positioned before it in the schema: the server's `fidelity_context=predecessor`), `actual`
  (that and the module before it in this prompt: what a per-pair encoding would give).
- placement: `layout` — the context and the segment at their schema layout positions, gaps included
  (what the server stores today); `compact` — the context's segments one after the other and the
  segment right after them, no gaps (the segment then sits as close to the system prompt and its
  predecessor as a full prefill would put it).
`balanced` recomputes, of each out-of-context segment, its first k tokens in their actual context (they
attend to everything placed before them) and reuses the rest of the encoding, as the engine does.
`predecessor@layout` and `balanced:16/predecessor@layout` are the server's modes: their answers check the
emulation against the engine's (benchmarks.fidelity_context_depth's answers, --engine-answers).
Agreement is the first 16 generated tokens equal to the full prefill's (the reference cache).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from transformers import DynamicCache

from benchmarks.fidelity import AGREE, GENERATE, _until_eos
from benchmarks.fidelity_context_depth import load_subset, percent, subset_parser
from benchmarks.fidelity_tasks import score
from benchmarks.harness import RESULTS, emit, log
from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelRuntime
from promptcache.model_runtime.engine.reuse_plan import in_context
from promptcache.pml import CachedSegment, PromptPlan


def parse_variant(variant: str) -> tuple[int, str, str]:
    """-> (head tokens recomputed, 0 for fast; rule; placement)."""
    spec, _, placement = variant.partition("@")
    head = 0
    if "/" in spec:
        mode, _, spec = spec.partition("/")
        head = int(mode.partition(":")[2] or 16)
    assert spec in ("schema", "predecessor", "actual") and placement in ("layout", "compact"), variant
    return head, spec, placement


def encoding_context(plan: PromptPlan, index: int, rule: str) -> tuple[int, ...]:
    cached = plan.cached[index]
    if in_context(plan, cached) or rule == "schema" or not cached.segment.owner:
        return tuple(cached.context_ids)
    if rule == "predecessor":
        return plan.schema.predecessor_context(cached.segment.segment_id, cached.context_ids) or cached.context_ids
    before = [c for c in plan.cached[:index] if c.segment.owner and c.segment.owner != cached.segment.owner]
    if not before:
        return tuple(cached.context_ids)
    previous = before[-1]  # its own context is what precedes it in the schema: the chain stays prefix-closed
    if previous.segment.segment_id in cached.context_ids:
        return tuple(cached.context_ids)
    return (*previous.context_ids, previous.segment.segment_id)


@torch.inference_mode()
def encode(model, plan: PromptPlan, cached: CachedSegment, context: tuple[int, ...], placement: str,
           at: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) [1, H_kv, n, D] of `cached`'s tokens encoded after `context`, with its
    first token at position `at`."""
    segments = [plan.schema.segments[i] for i in sorted(context, key=lambda i: plan.schema.segments[i].start)]
    segments.append(cached.segment)
    tokens = [t for s in segments for t in s.token_ids]
    if placement == "layout":
        positions = [p for s in segments for p in s.position_ids]
    else:
        positions = list(range(len(tokens)))
    n = len(cached.segment.token_ids)
    shift = at - positions[-n]
    out = model(input_ids=torch.tensor([tokens]), position_ids=torch.tensor([[p + shift for p in positions]]),
                attention_mask=torch.ones((1, len(tokens)), dtype=torch.long), use_cache=True)
    return [(layer.keys[:, :, -n:], layer.values[:, :, -n:]) for layer in out.past_key_values.layers]


@torch.inference_mode()
def run(model, cache: DynamicCache, tokens: list[int], at: int) -> torch.Tensor:
    """Compute `tokens` at positions at.. attending to all of `cache` (appended to it); last logits."""
    out = model(input_ids=torch.tensor([tokens]), position_ids=torch.tensor([list(range(at, at + len(tokens)))]),
                attention_mask=torch.ones((1, cache.get_seq_length() + len(tokens)), dtype=torch.long),
                past_key_values=cache, use_cache=True)
    return out.logits[0, -1]


@torch.inference_mode()
def answer(model, plan: PromptPlan, head: int, rule: str, placement: str, eos: set[int]) -> list[int]:
    cache, at, logits = DynamicCache(), 0, None
    pieces = sorted([(c.segment.start, "cached", i) for i, c in enumerate(plan.cached)]
                    + [(r.start, "new", i) for i, r in enumerate(plan.new_runs)])
    for number, (_, kind, index) in enumerate(pieces):
        last = number == len(pieces) - 1
        if kind == "new":
            tokens = list(plan.new_runs[index].token_ids)
            logits = run(model, cache, tokens, at)
            at += len(tokens)
            continue
        cached = plan.cached[index]
        n = len(cached.segment.token_ids)
        kv = encode(model, plan, cached, encoding_context(plan, index, rule), placement, at)
        recompute = min(head, n) if head and not in_context(plan, cached) else 0
        if recompute:
            logits = run(model, cache, list(cached.segment.token_ids[:recompute]), at)
        keep = n - 1 if last else n  # a prompt ending in cached tokens recomputes its last one (engine rule)
        if keep > recompute:
            for layer, (keys, values) in enumerate(kv):
                cache.update(keys[:, :, recompute:keep], values[:, :, recompute:keep], layer)
        if last:
            logits = run(model, cache, [cached.segment.token_ids[-1]], at + n - 1)
        at += n
    generated = []
    for _ in range(GENERATE):
        token = int(torch.argmax(logits))
        if token in eos:
            break
        generated.append(token)
        logits = run(model, cache, [token], at)
        at += 1
    return generated


def main() -> None:
    parser = subset_parser(__doc__, ["predecessor@layout", "predecessor@compact"], RESULTS / "fidelity_compact.jsonl")
    parser.add_argument("--engine-answers", type=Path, help="fidelity_context_depth answers to check against")
    args = parser.parse_args()
    loaded, eval_set, items, references = load_subset(args)
    runtime = ModelRuntime(loaded, build_store(StoreConfig()))
    for text in eval_set.schemas.values():
        runtime.add_schema(runtime.parse_schema(text), encode=False)
    eos = set(loaded.eos_token_ids)
    engine_texts: dict[tuple[str, str], str] = {}  # (variant, prompt) -> the engine's answer text
    if args.engine_answers:
        for line in args.engine_answers.read_text().splitlines():
            row = json.loads(line)
            engine_texts[(row["variant"], row["prompt"])] = row["text"]
    for variant in args.variants:
        head, rule, placement = parse_variant(variant)
        groups = defaultdict(list)
        same_as_engine = []
        server_name = f"{f'balanced:{head}' if head else 'fast'}/{rule}"
        for item, reference in zip(items, references):
            tokens = _until_eos(answer(loaded.model, runtime.plan(item.prompt), head, rule, placement, eos), eos)
            text = loaded.tokenizer.decode(tokens, skip_special_tokens=True)
            agree = tokens[:AGREE] == list(reference.token_ids)[:AGREE]
            groups[item.task].append((score(text, item), score(reference.text, item), agree, item.meta.get("k", 0)))
            engine_text = engine_texts.get((server_name, item.prompt))
            if placement == "layout" and engine_text is not None:
                same_as_engine.append(text == engine_text)
        for task, rows in groups.items():
            emit({"bench": "fidelity_compact", "variant": variant, "task": task, "seed": args.seed,
                  "num_prompts": len(rows), "accuracy": percent(r[0] for r in rows),
                  "full_prefill_accuracy": percent(r[1] for r in rows), "agreement": percent(r[2] for r in rows),
                  "agreement_by_k": {k: percent(r[2] for r in rows if r[3] == k) for k in sorted({r[3] for r in rows})},
                  **({"same_text_as_engine": percent(same_as_engine)} if same_as_engine else {})}, args.out)
        log(f"{variant} done")


if __name__ == "__main__":
    main()

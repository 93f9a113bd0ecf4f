"""Which second encoding, and how much recompute, would raise greedy agreement? An in-process
experiment on the evaluation's fact-QA and retrieval prompts, through the engine the server runs (not
over HTTP: no TTFT here, only answers).

    python -m benchmarks.fidelity_context_depth --limit 100 --reference-cache /tmp/depth_refs.pt \
        --variants fast/predecessor fast/window:2 fast/chain balanced:16/predecessor balanced:64/predecessor

`fidelity_context=predecessor` reuses each out-of-context module's KV encoded after the one module
before it in the schema. Its answers are as often right as a full prefill's, but their first 16 tokens
equal the full prefill's on only 60 % (fact QA) / 79 % (retrieval) of prompts, falling with the number of
documents a prompt imports. A variant is "mode[:k]/rule": the mode and k as the server has them (always
with contiguous positions), and the rule that picks each out-of-context module's second encoding,
swapped in for the run only (`Schema.predecessor_context`):
- predecessor   the server's rule (the one module before it in the schema);
- window:N      the N modules before it in the schema, each link of the chain encoded after the links
                before it (the module encoder's chain semantics: N encodings per module);
- chain         every module before it: the KV a prefill of the whole schema in order gives.
Greedy, 32 tokens; agreement is the first 16 generated tokens equal to an in-process full prefill's
(benchmarks.fidelity's reference, computed for the chosen prompts or loaded from --reference-cache);
per task and k: accuracy, agreement, recomputed fraction of the reused module tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from collections import defaultdict
from pathlib import Path

from benchmarks.fidelity import AGREE, GENERATE, Answer, _until_eos, cached_references, reference_answers
from benchmarks.fidelity_tasks import EvalItem, EvalSet, build_eval_set, score
from benchmarks.harness import RESULTS, emit, log, setup
from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import LoadedModel, ModelConfig, ModelRuntime, SamplingParams, load_model
from promptcache.model_runtime.engine import Engine, EngineConfig, Fidelity
from promptcache.pml.schema import Schema

SERVER_RULE = Schema.predecessor_context


def _modules_before(schema: Schema, segment_id: int, context_ids) -> tuple[list[int], set[int]] | None:
    segment, context = schema.segments[segment_id], set(context_ids)
    if not segment.owner:
        return None
    before = sorted((s for s in schema.segments if s.owner not in ("", segment.owner) and s.is_cached
                     and not s.is_placeholder and s.end <= segment.start and s.segment_id not in context),
                    key=lambda s: (s.start, s.segment_id))
    return ([s.segment_id for s in before], context) if before else None


def window_rule(depth: int | None):
    """A predecessor rule reaching `depth` modules back (None: all of them)."""
    def rule(schema: Schema, segment_id: int, context_ids) -> tuple[int, ...] | None:
        found = _modules_before(schema, segment_id, context_ids)
        if found is None:
            return None
        before, context = found
        chosen = before if depth is None else before[-depth:]
        return tuple(sorted({*context, *chosen}, key=lambda i: (schema.segments[i].start, i)))
    return rule


def parse_variant(variant: str) -> tuple[Fidelity, object]:
    mode_spec, _, rule = variant.partition("/")
    mode, _, k = mode_spec.partition(":")
    fidelity = Fidelity(mode, int(k) if k else 16, positions="contiguous", context="predecessor")
    if rule in ("", "predecessor"):
        return fidelity, SERVER_RULE
    if rule == "chain":
        return fidelity, window_rule(None)
    name, _, depth = rule.partition(":")
    if name != "window" or not depth.isdigit():
        raise SystemExit(f"unknown rule in {variant!r}: predecessor, window:N or chain")
    return fidelity, window_rule(int(depth))


async def _answers(engine: Engine, runtime: ModelRuntime, prompts: list[str], fidelity: Fidelity
                   ) -> list[tuple[list[int], int, int]]:
    """Per prompt: generated tokens, recomputed tokens, reused module tokens."""
    params, gate = SamplingParams(max_tokens=GENERATE, temperature=0), asyncio.Semaphore(8)

    async def one(prompt: str) -> tuple[list[int], int, int]:
        async with gate:
            tokens, usage, modules = [], None, ()
            async for event in engine.submit(runtime.plan(prompt), params, fidelity=fidelity):
                if event.error is not None:
                    raise RuntimeError(event.error)
                if event.token_id is not None:
                    tokens.append(event.token_id)
                usage, modules = event.usage or usage, event.modules or modules
            assert usage is not None, "the final event carries usage"
            return tokens, usage.recomputed_tokens, sum(m.num_tokens for m in modules)

    return await asyncio.gather(*(one(p) for p in prompts))


def subset_parser(description: str, variants: list[str], out: Path) -> argparse.ArgumentParser:
    """The arguments the in-process fidelity experiments share (this one and fidelity_compact)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-task", type=int, default=200, help="the evaluation set's size")
    parser.add_argument("--limit", type=int, default=100, help="the first N prompts of each task")
    parser.add_argument("--tasks", nargs="+", default=["fact_qa", "ruler"])
    parser.add_argument("--variants", nargs="+", default=variants)
    parser.add_argument("--reference-cache", type=Path, help="keep the chosen prompts' full-prefill answers here "
                                                             "(a file per --limit/--tasks/--seed: it is rewritten)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=out)
    return parser


def load_subset(args) -> tuple[LoadedModel, EvalSet, list[EvalItem], list[Answer]]:
    """The fp32 model, the evaluation set, its first `--limit` prompts of each task and their full-prefill
    answers (computed in process, or loaded from --reference-cache)."""
    setup(args.threads)
    loaded = load_model(ModelConfig(dtype="float32", fuse_layers=False))
    eval_set = build_eval_set(per_task=args.per_task, seed=args.seed)
    items = [item for task in args.tasks for item in eval_set.by_task(task)[: args.limit]]
    references = cached_references(args.reference_cache, items, lambda: reference_answers(loaded, eval_set, items))
    return loaded, eval_set, items, references


def main() -> None:
    args = subset_parser(__doc__, ["fast/predecessor", "fast/window:2", "fast/chain"],
                         RESULTS / "fidelity_context_depth.jsonl").parse_args()
    loaded, eval_set, items, references = load_subset(args)
    runtime = ModelRuntime(loaded, build_store(StoreConfig()))
    for text in eval_set.schemas.values():
        runtime.add_schema(runtime.parse_schema(text))
    eos = set(loaded.eos_token_ids)
    engine = Engine(runtime.module_encoder, EngineConfig(prefix=None))
    try:
        for variant in args.variants:
            fidelity, rule = parse_variant(variant)
            Schema.predecessor_context = rule
            try:
                generated = asyncio.run(_answers(engine, runtime, [item.prompt for item in items], fidelity))
            finally:
                Schema.predecessor_context = SERVER_RULE
            groups: dict[tuple[str, int], list[tuple[bool, bool, bool, int, int]]] = defaultdict(list)
            with args.out.with_suffix(".answers.jsonl").open("a") as fh:
                for item, reference, (tokens, recomputed, reused) in zip(items, references, generated):
                    tokens = _until_eos(tokens, eos)
                    text = loaded.tokenizer.decode(tokens, skip_special_tokens=True)
                    agree = tokens[:AGREE] == list(reference.token_ids)[:AGREE]
                    groups[(item.task, item.meta.get("k", 0))].append(
                        (score(text, item), score(reference.text, item), agree, recomputed, reused))
                    fh.write(json.dumps({"variant": variant, "task": item.task, "meta": item.meta, "text": text,
                                         "correct": score(text, item), "agree": agree, "prompt": item.prompt}) + "\n")
            for task in args.tasks:
                rows = [r for (t, _), values in groups.items() if t == task for r in values]
                by_k = {k: values for (t, k), values in sorted(groups.items()) if t == task}
                emit({"bench": "fidelity_context_depth", "variant": variant, "task": task, "seed": args.seed,
                      "num_prompts": len(rows), "accuracy": percent(r[0] for r in rows),
                      "full_prefill_accuracy": percent(r[1] for r in rows),
                      "agreement": percent(r[2] for r in rows),
                      "agreement_by_k": {k: percent(r[2] for r in v) for k, v in by_k.items()},
                      "recomputed_fraction": round(sum(r[3] for r in rows) / max(1, sum(r[3] + r[4] for r in rows)), 4)},
                     args.out)
            log(f"{variant} done")
    finally:
        engine.stop()


def percent(flags) -> float:
    """Percentage of true flags, one decimal (0 for none)."""
    values = list(flags)
    return round(100 * statistics.mean(values), 1) if values else 0.0


if __name__ == "__main__":
    main()

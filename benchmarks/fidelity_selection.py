"""Which module tokens to recompute: selection strategies for `balanced`, emulated exactly in-process.

    python -m benchmarks.fidelity_selection --per-task 20 --budgets 0.1 0.2

Reusing a module's KV outside the context it was encoded in is one forward pass with a block mask: a
module's rows attend to the rows it was encoded after and causally to themselves; new text attends to
every prompt row positioned before it. Recomputing a module token in its actual context is the same pass
with that row's mask widened to every prompt row positioned before it (earlier recomputed rows are their
recomputed versions, the others their cached ones): exactly what the engine's `balanced` mode computes
(tests/model_runtime/oracles.py builds the same masks to test it). So each strategy is one masked forward
pass plus greedy decoding, on the fidelity evaluation's prompts (benchmarks/fidelity_tasks.py), with no
engine on the path — a way to compare strategies before building one into the engine.

Strategies, at a budget = a share of the prompt's reused module tokens (only tokens of modules that are not
in their encoding context can be picked):
- head:        the first k tokens of every out-of-context module (today's `balanced`, EPIC/LegoLink);
- deviation:   the tokens whose layer-1 keys and values move most between the reused pass and a full
               prefill (CacheBlend's selection);
- attention:   the tokens the question attends to most in the reused pass (summed over layers and heads),
               in 16-token chunks (a query-aware selection in the spirit of ProphetKV);
- head+attention: 4 head tokens per module, the rest of the budget by attention.
Rows also for `fast` (nothing recomputed), `all` (every module token recomputed at the layout's positions)
and `full_prefill` (the evaluation's reference: contiguous positions). Accuracy with a 95 % Wilson
interval, % of full prefill, greedy 16-token agreement with full prefill. fp32.

`--reference-answers benchmarks/results/fidelity.answers.jsonl` takes `full_prefill` and `fast` from the
fidelity evaluation's stored answers to the same prompts (same seed, fp32; its reruns reproduced them
exactly) instead of generating them and skips `all`: a run then costs two forward passes and one greedy
decode per strategy and prompt; agreement is not reported, and every strategy is paired with `fast`, with
the first strategy at its budget, and with full prefill (accuracy points, 95 % interval).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from benchmarks.fidelity import GENERATE, _until_eos, paired_difference, wilson
from benchmarks.fidelity_tasks import build_eval_set, score
from benchmarks.harness import RESULTS, emit, log, setup
from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelConfig, ModelRuntime, load_model
from promptcache.pml import PromptPlan

CHUNK = 16
CAPTURE = "selection_capture"


class Capture:
    """What the capture attention records during one forward pass (None: record nothing)."""

    question_rows: int | None = None     # attention of the last rows to every row, summed (layers, heads)
    attention: torch.Tensor | None = None
    kv_layer: int | None = None          # keys and values of this layer, per row
    kv: torch.Tensor | None = None


capture = Capture()


def _capturing_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if capture.question_rows is not None:
        q = query[0, :, -capture.question_rows:]                                  # [H, Q, D]
        k = key[0].repeat_interleave(query.shape[1] // key.shape[1], dim=0)        # [H, n, D]
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling   # [H, Q, n]
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask[0, 0, -capture.question_rows:], float("-inf"))
        mass = torch.softmax(scores, dim=-1).sum(dim=(0, 1))                      # [n]
        capture.attention = mass if capture.attention is None else capture.attention + mass
    if capture.kv_layer == module.layer_idx:
        capture.kv = torch.cat([key[0], value[0]], dim=-1).transpose(0, 1).flatten(1).float()  # [n, 2*H_kv*D]
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  **kwargs)


@dataclass
class Rows:
    """A prompt as rows in position order, with what each row is."""

    token_ids: list[int]
    positions: list[int]
    segment_of: list[int | None]   # cached segment id, None for new text
    in_context: set[int]           # segments whose stored KV equals a full prefill's here
    context_of: dict[int, tuple[int, ...]]
    num_question: int              # new-text rows after the last module (the question and the markup)

    def candidates(self) -> list[int]:
        """Rows of modules reused out of their encoding context: what a strategy may recompute."""
        return [r for r, s in enumerate(self.segment_of) if s is not None and s not in self.in_context]

    def reused(self) -> int:
        return sum(s is not None for s in self.segment_of)


def rows_of(plan: PromptPlan) -> Rows:
    pairs = [(p, t, c.segment.segment_id) for c in plan.cached for p, t in zip(c.segment.position_ids,
                                                                                 c.segment.token_ids)]
    pairs += [(p, t, None) for run in plan.new_runs for p, t in zip(range(run.start, run.end), run.token_ids)]
    pairs.sort()
    context_of = {c.segment.segment_id: tuple(c.context_ids) for c in plan.cached}
    # In context: what precedes the segment in the prompt is exactly what it was encoded after.
    in_context, before = set(), []
    for _, _, sid in pairs:
        if sid is not None and sid not in before:
            if tuple(before) == context_of[sid]:
                in_context.add(sid)
            before.append(sid)
        elif sid is None:
            before.append(None)
    last_module = max(i for i, (_, _, sid) in enumerate(pairs) if sid is not None)
    return Rows([t for _, t, _ in pairs], [p for p, _, _ in pairs], [s for _, _, s in pairs], in_context,
                context_of, len(pairs) - 1 - last_module)


def mask_of(rows: Rows, recomputed: set[int]) -> torch.Tensor:
    """[1, 1, n, n] bool: reused module rows see their encoding context and themselves causally; new text
    and recomputed rows see every row positioned before them."""
    n = len(rows.token_ids)
    mask = torch.ones((n, n), dtype=torch.bool).tril()                      # [n, n] causal by position
    segment_rows: dict[int, list[int]] = {}
    for r, s in enumerate(rows.segment_of):
        if s is not None:
            segment_rows.setdefault(s, []).append(r)
    for s, members in segment_rows.items():
        allowed = torch.zeros(n, dtype=torch.bool)                           # [n]
        for c in rows.context_of[s]:
            allowed[segment_rows.get(c, [])] = True
        for k, r in enumerate(members):
            if r in recomputed:
                continue
            mask[r] = allowed
            mask[r, members[: k + 1]] = True
    return mask[None, None]


@torch.inference_mode()
def generate(model, rows: Rows, mask: torch.Tensor, positions: list[int] | None = None,
             eos: set[int] = frozenset(), next_position: int | None = None) -> list[int]:
    """Greedy tokens after the prompt's rows at `positions` (default: the layout's), the first generated
    one at `next_position` (default: after the largest prompt position)."""
    ids = torch.tensor([rows.token_ids])
    pos = torch.tensor([positions or rows.positions])
    out = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True)
    next_pos = int(pos[0].max()) + 1 if next_position is None else next_position
    past, logits, tokens = out.past_key_values, out.logits[0, -1], []
    for _ in range(GENERATE):
        token = int(torch.argmax(logits))
        tokens.append(token)
        if token in eos:
            break
        ones = torch.ones((1, past.get_seq_length() + 1), dtype=torch.long)
        out = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[next_pos]]), attention_mask=ones,
                    past_key_values=past, use_cache=True)
        past, next_pos, logits = out.past_key_values, next_pos + 1, out.logits[0, -1]
    return _until_eos(tokens, eos)


@torch.inference_mode()
def signals(model, rows: Rows, deviation_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the question's attention mass in the reused pass, and the layer's KV deviation between the
    reused pass and a full prefill (both [n])."""
    ids, pos = torch.tensor([rows.token_ids]), torch.tensor([rows.positions])
    capture.question_rows, capture.attention, capture.kv_layer = rows.num_question, None, deviation_layer
    model(input_ids=ids, position_ids=pos, attention_mask=mask_of(rows, set()), use_cache=False)
    attention, reused_kv = capture.attention, capture.kv
    capture.question_rows = None
    full = torch.ones((len(rows.token_ids),) * 2, dtype=torch.bool).tril()[None, None]
    model(input_ids=ids, position_ids=pos, attention_mask=full, use_cache=False)
    deviation = (capture.kv - reused_kv).pow(2).sum(dim=-1)                  # [n]
    capture.kv_layer = capture.kv = None
    return attention, deviation


def select(strategy: str, rows: Rows, budget: int, attention: torch.Tensor, deviation: torch.Tensor) -> set[int]:
    candidates = rows.candidates()
    if budget <= 0 or not candidates:
        return set()
    by_segment: dict[int, list[int]] = {}
    for r in candidates:
        by_segment.setdefault(rows.segment_of[r], []).append(r)
    if strategy == "head":
        k = max(1, budget // len(by_segment))
        return {r for members in by_segment.values() for r in members[:k]}
    if strategy == "deviation":
        return set(sorted(candidates, key=lambda r: -float(deviation[r]))[:budget])
    chosen: set[int] = set()
    if strategy == "head+attention":
        chosen = {r for members in by_segment.values() for r in members[:4]}
    chunks = [members[i: i + CHUNK] for members in by_segment.values() for i in range(0, len(members), CHUNK)]
    chunks.sort(key=lambda chunk: -float(attention[chunk].sum()))
    for chunk in chunks:
        if len(chosen) >= budget:
            break
        chosen.update(chunk[: budget - len(chosen)])
    return chosen


def prepare(args):
    """The fp32 model with the capturing attention, the PML planner, and the evaluation set's schemas
    registered (not encoded: every variant is a masked forward pass)."""
    setup(args.threads)
    loaded = load_model(ModelConfig(dtype="float32"))
    runtime = ModelRuntime(loaded, build_store(StoreConfig()))  # the PML planner (and its attention)
    AttentionInterface.register(CAPTURE, _capturing_attention)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)
    loaded.model.set_attn_implementation(CAPTURE)
    eval_set = build_eval_set(per_task=args.per_task, seed=args.seed)
    for text in eval_set.schemas.values():
        runtime.add_schema(runtime.parse_schema(text), encode=False)
    return loaded, runtime, eval_set


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-task", type=int, default=200)
    parser.add_argument("--tasks", nargs="+", default=["fact_qa", "ruler"])
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.1, 0.2])
    parser.add_argument("--strategies", nargs="+", default=["head", "deviation", "attention", "head+attention"])
    parser.add_argument("--deviation-layer", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference-answers", type=Path,
                        help="a fidelity .answers.jsonl: full_prefill and fast from it (module docstring)")
    parser.add_argument("--out", type=Path, default=RESULTS / "fidelity_selection.jsonl")
    args = parser.parse_args()
    if args.reference_answers:
        stored_run(args)
        return
    loaded, runtime, eval_set = prepare(args)
    model, eos = loaded.model, set(loaded.eos_token_ids)
    variants = ["full_prefill", "fast", "all"] + [f"{s}@{b:g}" for b in args.budgets for s in args.strategies]
    for task in args.tasks:
        items = [item for item in eval_set.items if item.task == task]
        answers: dict[str, list[list[int]]] = {v: [] for v in variants}
        recomputed: dict[str, list[float]] = {v: [] for v in variants}
        for index, item in enumerate(items):
            rows = rows_of(runtime.plan(item.prompt))
            n = len(rows.token_ids)
            full = torch.ones((n, n), dtype=torch.bool).tril()[None, None]
            answers["full_prefill"].append(generate(model, rows, full, list(range(n)), eos))
            answers["fast"].append(generate(model, rows, mask_of(rows, set()), eos=eos))
            every = set(rows.candidates())
            answers["all"].append(generate(model, rows, mask_of(rows, every), eos=eos))
            recomputed["fast"].append(0.0)
            recomputed["all"].append(len(every) / max(1, rows.reused()))
            attention, deviation = signals(model, rows, args.deviation_layer)
            for budget in args.budgets:
                for strategy in args.strategies:
                    chosen = select(strategy, rows, int(budget * rows.reused()), attention, deviation)
                    answers[f"{strategy}@{budget:g}"].append(generate(model, rows, mask_of(rows, chosen), eos=eos))
                    recomputed[f"{strategy}@{budget:g}"].append(len(chosen) / max(1, rows.reused()))
            if index % 10 == 0:
                log(f"{task} {index}/{len(items)}")
        reference = answers["full_prefill"]
        full_accuracy = 100 * statistics.mean(score(loaded.tokenizer.decode(a, skip_special_tokens=True), item)
                                              for a, item in zip(reference, items))
        for variant in variants:
            correct = [score(loaded.tokenizer.decode(a, skip_special_tokens=True), item)
                       for a, item in zip(answers[variant], items)]
            low, high = wilson(sum(correct), len(correct))
            accuracy = 100 * sum(correct) / len(correct)
            emit({"bench": "fidelity_selection", "task": task, "variant": variant, "num_prompts": len(items),
                  "accuracy": round(accuracy, 1), "ci95": [round(low, 1), round(high, 1)],
                  "percent_of_full_prefill": round(100 * accuracy / full_accuracy, 1) if full_accuracy else None,
                  "agreement": round(100 * statistics.mean(a[:16] == r[:16] for a, r in zip(answers[variant], reference)), 1),
                  "recomputed_fraction": round(statistics.mean(recomputed[variant]), 3) if recomputed[variant] else 0.0},
                 args.out)


def stored_correctness(path: Path, task: str, mode: str, items: list) -> list[bool]:
    """Per prompt, in item order: whether `mode`'s stored answer was correct (the stored rows must be
    the same prompts: their metadata is compared)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows = [r for r in rows if r["task"] == task and r["mode"] == mode][: len(items)]
    if len(rows) < len(items) or any(r["meta"] != item.meta for r, item in zip(rows, items)):
        raise SystemExit(f"{path} does not hold {mode} answers to these {len(items)} {task} prompts")
    return [r["correct"] for r in rows]


def stored_run(args) -> None:
    """The strategies only, paired with stored full-prefill and fast answers (module docstring)."""
    loaded, runtime, eval_set = prepare(args)
    model, eos = loaded.model, set(loaded.eos_token_ids)
    variants = [f"{s}@{b:g}" for b in args.budgets for s in args.strategies]
    for task in args.tasks:
        items = [item for item in eval_set.items if item.task == task]
        correct = {mode: stored_correctness(args.reference_answers, task, mode, items)
                   for mode in ("full_prefill", "fast")}
        correct.update({v: [] for v in variants})
        recomputed: dict[str, list[float]] = {v: [] for v in variants}
        for index, item in enumerate(items):
            rows = rows_of(runtime.plan(item.prompt))
            attention, deviation = signals(model, rows, args.deviation_layer)
            for budget in args.budgets:
                for strategy in args.strategies:
                    chosen = select(strategy, rows, int(budget * rows.reused()), attention, deviation)
                    tokens = generate(model, rows, mask_of(rows, chosen), eos=eos)
                    correct[f"{strategy}@{budget:g}"].append(
                        score(loaded.tokenizer.decode(tokens, skip_special_tokens=True), item))
                    recomputed[f"{strategy}@{budget:g}"].append(len(chosen) / max(1, rows.reused()))
            if index % 10 == 0:
                log(f"{task} {index}/{len(items)}")
        full_accuracy = 100 * sum(correct["full_prefill"]) / len(items)
        for variant in ["full_prefill", "fast", *variants]:
            low, high = wilson(sum(correct[variant]), len(items))
            accuracy = 100 * sum(correct[variant]) / len(items)
            emit({"bench": "fidelity_selection", "task": task, "variant": variant, "num_prompts": len(items),
                  "accuracy": round(accuracy, 1), "ci95": [round(low, 1), round(high, 1)],
                  "percent_of_full_prefill": round(100 * accuracy / full_accuracy, 1) if full_accuracy else None,
                  "recomputed_fraction": round(statistics.mean(recomputed[variant]), 3) if variant in recomputed
                  else 0.0, "reference": str(args.reference_answers)}, args.out)
        for budget in args.budgets:
            first = f"{args.strategies[0]}@{budget:g}"
            for variant in [f"{s}@{budget:g}" for s in args.strategies]:
                for against in ["fast", "full_prefill", *([first] if variant != first else [])]:
                    diffs = [int(a) - int(b) for a, b in zip(correct[variant], correct[against])]
                    mean, low, high = paired_difference(diffs)
                    emit({"bench": "fidelity_selection_paired", "task": task, "variant": variant, "against": against,
                          "difference_points": mean, "ci95": [low, high],
                          "changed": sum(1 for d in diffs if d)}, args.out)


if __name__ == "__main__":
    main()

"""Query-aware recompute at re-aligned positions: does recomputing the tokens the question attends to
beat `balanced`'s head tokens? Emulated exactly, in-process, through the engine tests' oracle.

    python -m benchmarks.fidelity_query_selection --per-task 200 --budgets 0.2 \
        --against benchmarks/results/fidelity_positions.answers.jsonl

`balanced` recomputes the first k tokens of every out-of-context module (EPIC/LegoLink). ProphetKV-style
selection asks the question instead: run the prompt as `fast` does, see which reused tokens the
question's rows attend to (attention mass summed over layers and heads), and recompute those, in
16-token chunks, in their actual context. Each variant is a ReusePlan (`recompute_selected`, the engine's
own plan type, at contiguous positions as the server's default) evaluated by
`tests/model_runtime/oracles.reuse_reference_rows`: one forward pass whose explicit mask computes what the
engine computes for that plan, then greedy decoding, every generated token seeing what the last prompt row
sees. Variants, at a budget = a share of the prompt's cached module tokens:
- head:16           `balanced` with k = 16 as the server runs it (a check: its answers should equal the
                    server's stored `balanced:16@contiguous` answers);
- head:             the budget split evenly over the out-of-context modules' first tokens;
- attention:        the budget in the chunks the question attends to most in the `fast` pass;
- head16+attention: k = 16 heads, the rest of the budget by attention.
fp32, the evaluation's prompts (seed 0), paired prompt by prompt with a stored server run's
`full_prefill`, `fast@contiguous` and `balanced:16/32@contiguous` answers (`--against`). Greedy agreement is
on the first 16 tokens of the re-tokenized stored reference text (the stored runs keep text, not ids).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.fidelity import GENERATE, _until_eos, paired_difference, wilson
from benchmarks.fidelity_selection import CHUNK, capture, prepare
from benchmarks.fidelity_tasks import score
from benchmarks.harness import RESULTS, emit, log
from promptcache.model_runtime.engine import Fidelity, resolve
from promptcache.model_runtime.engine.reuse_plan import in_context, realigned, recompute_selected
from promptcache.pml import PromptPlan
from tests.model_runtime.oracles import reuse_reference_rows

STORED = ("full_prefill", "fast@contiguous", "balanced:16@contiguous", "balanced:32@contiguous")


class PromptOracle:
    """One prompt's reused KV, computed once by the oracle's pass over the `fast` plan's cached rows (every
    segment with the mask it was encoded under, moved copies included), then any ReusePlan's stream run
    over it: the same rows and masks `reuse_reference_rows` builds for that plan, without recomputing
    the cached rows for every plan. Valid for plans whose uses keep the `fast` plan's shifts (any
    selection of recomputed tokens: positions are ranks among the prompt's, which do not change)."""

    def __init__(self, model, plan: PromptPlan) -> None:
        self.model, self.plan = model, plan
        self.fast = realigned(resolve(plan, Fidelity("fast")))
        tokens, positions, mask, use_rows = reuse_reference_rows(plan, self.fast)
        self.num_cached = len(tokens) - len(self.fast.token_ids)
        index_of = {id(c): i for i, c in enumerate(plan.cached)}
        self.row_of = {index_of[id(u.cached)]: rows for u, rows in zip(self.fast.uses, use_rows)}
        self.shift_of = {index_of[id(u.cached)]: u.shift for u in self.fast.uses}
        self.index_of = index_of
        n = self.num_cached
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([tokens[:n]]), position_ids=torch.tensor([positions[:n]]),
                        attention_mask=mask[:, :, :n, :n], use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values

    def stream_mask(self, reuse) -> torch.Tensor:
        """[1, 1, S, cached + S] bool: stream row k sees the reused rows of every use it may see (from
        `visible_from` on) and the stream causally, as the oracle's mask does."""
        num_stream = len(reuse.token_ids)
        mask = torch.zeros((num_stream, self.num_cached + num_stream), dtype=torch.bool)
        for use in reuse.uses:
            index = self.index_of[id(use.cached)]
            assert use.shift == self.shift_of[index], "a plan whose shifts differ from the fast plan's"
            mask[use.visible_from:, self.row_of[index][use.first: use.last]] = True
        mask[:, self.num_cached:] = torch.ones((num_stream, num_stream), dtype=torch.bool).tril()
        return mask[None, None]

    @torch.inference_mode()
    def question_attention(self, question_rows: int) -> dict[int, torch.Tensor]:
        """Per cached segment index: the attention mass each of its tokens gets from the last
        `question_rows` stream rows of the `fast` plan, summed over layers and heads."""
        capture.question_rows, capture.attention = question_rows, None
        try:
            self.run(self.fast, logits_only=True)
            mass = capture.attention                                             # [cached + S]
        finally:
            capture.question_rows = capture.attention = None
        return {index: mass[rows] for index, rows in self.row_of.items()}

    @torch.inference_mode()
    def run(self, reuse, eos: set[int] = frozenset(), logits_only: bool = False) -> list[int]:
        """Greedy tokens the engine would generate for `reuse` (every generated row sees what the last
        prompt row sees and the generated rows)."""
        mask = self.stream_mask(reuse)
        try:
            out = self.model(input_ids=torch.tensor([list(reuse.token_ids)]),
                             position_ids=torch.tensor([self.oracle_positions(reuse)]),
                             attention_mask=mask, past_key_values=self.cache, use_cache=True)
            if logits_only:
                return []
            seen, logits, generated = mask[0, 0, -1], out.logits[0, -1], []
            for step in range(GENERATE):
                token = int(torch.argmax(logits))
                generated.append(token)
                if token in eos:
                    break
                step_mask = torch.cat([seen, torch.ones(step + 1, dtype=torch.bool)])[None, None, None]
                out = self.model(input_ids=torch.tensor([[token]]),
                                 position_ids=torch.tensor([[reuse.next_position + step]]),
                                 attention_mask=step_mask, past_key_values=self.cache, use_cache=True)
                logits = out.logits[0, -1]
            return _until_eos(generated, eos)
        finally:
            self.cache.crop(self.num_cached - self.cache.get_seq_length())  # back to the cached rows

    def oracle_positions(self, reuse) -> list[int]:
        _, positions, _, _ = reuse_reference_rows(self.plan, reuse)
        return positions[len(positions) - len(reuse.token_ids):]


def chosen_tokens(strategy: str, plan: PromptPlan, budget: int, mass: dict[int, torch.Tensor]) -> dict[int, list[int]]:
    """Token indices per cached segment index that `strategy` recomputes within `budget` tokens."""
    candidates = [i for i, c in enumerate(plan.cached) if not in_context(plan, c)]
    if not candidates:
        return {}
    lengths = {i: len(plan.cached[i].segment.token_ids) for i in candidates}
    if strategy == "head:16":
        return {i: list(range(min(16, lengths[i]))) for i in candidates}
    if strategy == "head":
        k = max(1, budget // len(candidates))
        return {i: list(range(min(k, lengths[i]))) for i in candidates}
    chosen: dict[int, set[int]] = {i: set() for i in candidates}
    if strategy == "head16+attention":
        chosen = {i: set(range(min(16, lengths[i]))) for i in candidates}
    chunks = [(i, range(start, min(start + CHUNK, lengths[i]))) for i in candidates
              for start in range(0, lengths[i], CHUNK)]
    chunks.sort(key=lambda chunk: -float(mass[chunk[0]][list(chunk[1])].sum()))
    used = sum(len(tokens) for tokens in chosen.values())
    for i, chunk in chunks:
        fresh = [j for j in chunk if j not in chosen[i]][: max(0, budget - used)]
        chosen[i].update(fresh)
        used += len(fresh)
    return {i: sorted(tokens) for i, tokens in chosen.items() if tokens}


def stored_answers(path: Path, task: str, items: list) -> dict[str, list[dict]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    out = {}
    for mode in STORED:
        picked = [r for r in rows if r["task"] == task and r["mode"] == mode][: len(items)]
        if len(picked) < len(items) or any(r["meta"] != item.meta for r, item in zip(picked, items)):
            raise SystemExit(f"{path} does not hold {mode} answers to these {len(items)} {task} prompts")
        out[mode] = picked
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, required=True, help="a fidelity .answers.jsonl (module docstring)")
    parser.add_argument("--per-task", type=int, default=200, help="the evaluation set's size (as stored)")
    parser.add_argument("--limit", type=int, help="run only the first N prompts of each task")
    parser.add_argument("--tasks", nargs="+", default=["fact_qa", "ruler"])
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.2])
    parser.add_argument("--strategies", nargs="+", default=["head:16", "head", "attention", "head16+attention"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "fidelity_query_selection.jsonl")
    args = parser.parse_args()
    loaded, runtime, eval_set = prepare(args)
    model, eos, tokenizer = loaded.model, set(loaded.eos_token_ids), loaded.tokenizer
    variants = [("head:16", 0.0)] if "head:16" in args.strategies else []
    variants += [(s, b) for b in args.budgets for s in args.strategies if s != "head:16"]
    answers_file = args.out.with_suffix(".answers.jsonl").open("a")
    for task in args.tasks:
        items = eval_set.by_task(task)
        stored = stored_answers(args.against, task, items)
        items = items[: args.limit or len(items)]
        stored = {mode: rows[: len(items)] for mode, rows in stored.items()}
        reference_ids = [tokenizer.encode(r["text"], add_special_tokens=False)[:16] for r in stored["full_prefill"]]
        correct = {v: [] for v in variants} | {m: [r["correct"] for r in stored[m]] for m in STORED}
        agree = {v: [] for v in variants}
        same_as_server = {v: [] for v in variants}
        recomputed = {v: [] for v in variants}
        for index, item in enumerate(items):
            plan = runtime.plan(item.prompt)
            reused = sum(len(c.segment.token_ids) for c in plan.cached)
            oracle = PromptOracle(model, plan)
            last_module = max(c.segment.end for c in plan.cached)
            mass = oracle.question_attention(sum(p >= last_module for p in oracle.fast.position_ids))
            for strategy, budget in variants:
                chosen = chosen_tokens(strategy, plan, int(budget * reused), mass)
                reuse = realigned(recompute_selected(plan, chosen, strategy))
                tokens = oracle.run(reuse, eos)
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                variant = (strategy, budget)
                correct[variant].append(score(text, item))
                agree[variant].append(tokens[:16] == reference_ids[index][: len(tokens[:16])])
                same_as_server[variant].append(text.strip() == stored["balanced:16@contiguous"][index]["text"].strip())
                recomputed[variant].append(reuse.num_recomputed / max(1, reused))
                answers_file.write(json.dumps({"task": task, "variant": f"{strategy}@{budget:g}", "meta": item.meta,
                                               "text": text, "correct": correct[variant][-1]}) + "\n")
            answers_file.flush()
            if index % 10 == 0:
                log(f"{task} {index}/{len(items)}")
        full = sum(correct["full_prefill"])
        for key in [*STORED, *variants]:
            label = key if isinstance(key, str) else f"{key[0]}@{key[1]:g}"
            low, high = wilson(sum(correct[key]), len(items))
            record = {"bench": "fidelity_query_selection", "task": task, "variant": label, "num_prompts": len(items),
                      "accuracy": round(100 * sum(correct[key]) / len(items), 1), "ci95": [round(low, 1), round(high, 1)],
                      "percent_of_full_prefill": round(100 * sum(correct[key]) / full, 1) if full else None}
            if key in agree:
                record |= {"agreement": round(100 * statistics.mean(agree[key]), 1),
                           "same_text_as_server_balanced16": round(100 * statistics.mean(same_as_server[key]), 1),
                           "recomputed_fraction": round(statistics.mean(recomputed[key]), 3)}
                for against in ("full_prefill", "balanced:16@contiguous", "balanced:32@contiguous"):
                    mean, lo, hi = paired_difference([int(a) - int(b) for a, b in zip(correct[key], correct[against])])
                    record[f"vs_{against}"] = [mean, lo, hi]
            emit(record, args.out)
    answers_file.close()


if __name__ == "__main__":
    main()

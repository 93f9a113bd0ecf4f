"""APE on stock weights: does tempering the attention from new text to reused modules win answers back?

    python -m benchmarks.fidelity_ape --tune-per-task 10 --per-task 200 \
        --against benchmarks/results/fidelity.answers.jsonl

Adaptive Parallel Encoding (Yang, Chen & Chen, ICLR 2025) is a training-free fix for contexts encoded
apart: a shared prefix before every context (promptcache encodes each module after the schema's system
prompt already), a lower attention temperature T for the query's attention to the contexts, and a scaling
factor S on that part's log-sum-exp before it is merged with the attention to everything else. Here it is
emulated exactly in-process on the `fast` layout (fidelity_selection's block mask: every module attends to
its encoding context and itself; new text attends to every row before it), with new-text rows and generated
tokens attending to module rows at temperature T and weight S. T = S = 1 is `fast`. The grid also has
position re-alignment on and off (`--realign 0 1`); on: new text sits at contiguous positions and sees every reused row's keys rotated to
its contiguous position (RoPE re-rotation; the reused rows themselves keep their encoding).

1. Tune, without labels (KL calibration): on a held-out eval set (`--tune-seed`), the first-token KL from a
   contiguous full prefill for each (re-alignment, T, S) of the grid; the lowest mean KL over the tasks wins.
2. Evaluate the winner on the evaluation's prompts (seed 0, `--per-task`), greedy, and pair each prompt's
   correctness with an earlier run's `fast` and `full_prefill` answers (`--against`, fp32, same eval set).
fp32. One JSON line per grid point and per task; every answer in a side file.
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

from benchmarks.fidelity import paired_difference, wilson
from benchmarks.fidelity_selection import Rows, generate, mask_of, rows_of
from benchmarks.fidelity_tasks import build_eval_set, score
from benchmarks.harness import RESULTS, emit, log, setup
from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelConfig, ModelRuntime, load_model

ATTENTION = "ape_emulation"


@dataclass
class Ape:
    """The tempering in force for the next passes (context None: plain SDPA)."""

    context: torch.Tensor | None = None  # [n] bool: prompt rows of modules (the parallel contexts)
    queries: torch.Tensor | None = None  # [n] bool: prompt rows whose attention is tempered (new text)
    temperature: float = 1.0
    scale: float = 1.0
    shift: torch.Tensor | None = None    # [n] int: how far reused rows' keys move for new text (re-alignment)
    inv_freq: torch.Tensor | None = None  # [D/2]: the model's RoPE frequencies


ape = Ape()


def _ape_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    # query [1, H, Q, D], key/value [1, H_kv, N, D]; every row attends as usual (SDPA with the block mask),
    # then the tempered rows (new text; every row of a decode step) are recomputed the APE way.
    out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                    **kwargs)                               # [1, Q, H, D]
    if ape.context is None:
        return out, None
    num_heads, num_q, num_k = query.shape[1], query.shape[2], key.shape[2]
    rows = ape.queries if num_q == len(ape.context) else torch.ones(num_q, dtype=torch.bool)  # prompt | decode
    if not rows.any():
        return out, None
    group = num_heads // key.shape[1]
    k = key[0].repeat_interleave(group, dim=0).float()                        # [H, N, D]
    v = value[0].repeat_interleave(group, dim=0).float()                      # [H, N, D]
    if ape.shift is not None:  # new text sees reused keys rotated to contiguous positions
        shift = torch.zeros(num_k, dtype=torch.long)
        shift[: len(ape.shift)] = ape.shift
        k = rotate(k, shift, ape.inv_freq)
    tempered = torch.matmul(query[0, :, rows].float(), k.transpose(-1, -2)) * scaling  # [H, R, N]
    if attention_mask is not None:
        tempered = tempered.masked_fill(~attention_mask[0, 0, rows], float("-inf"))
    context = torch.zeros(num_k, dtype=torch.bool)
    context[: len(ape.context)] = ape.context                                 # generated keys are not context
    to_context = (tempered / ape.temperature).masked_fill(~context, float("-inf"))
    to_rest = tempered.masked_fill(context, float("-inf"))
    lse_context, lse_rest = torch.logsumexp(to_context, -1), torch.logsumexp(to_rest, -1)  # [H, R]
    out_context = torch.nan_to_num(torch.matmul(torch.softmax(to_context, -1), v))         # [H, R, D]
    out_rest = torch.nan_to_num(torch.matmul(torch.softmax(to_rest, -1), v))
    weights = torch.softmax(torch.stack([lse_context * ape.scale, lse_rest]), dim=0)       # [2, H, R]
    mixed = weights[0, ..., None] * out_context + weights[1, ..., None] * out_rest          # [H, R, D]
    out = out.clone()
    out[0, rows] = mixed.transpose(0, 1).to(out.dtype)
    return out, None


def rotate(keys: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys [H, N, D] already carrying RoPE, moved by `shift` [N] positions (HF's rotate-half layout):
    rotations in each frequency plane compose, so this equals applying RoPE at the shifted position."""
    angle = shift[:, None].float() * inv_freq[None, :].float()                # [N, D/2]
    cos, sin = torch.cat([angle.cos()] * 2, dim=-1), torch.cat([angle.sin()] * 2, dim=-1)  # [N, D]
    half = keys.shape[-1] // 2
    rotated_half = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)  # [H, N, D]
    return keys * cos + rotated_half * sin


def realigned_positions(rows: Rows) -> tuple[list[int], torch.Tensor]:
    """Pass positions (reused rows at the layout's, new text contiguous) and each row's shift to contiguous."""
    positions = [layout if segment is not None else index
                 for index, (layout, segment) in enumerate(zip(rows.positions, rows.segment_of))]
    shift = torch.tensor([index - p if segment is not None else 0
                          for index, (p, segment) in enumerate(zip(rows.positions, rows.segment_of))])
    return positions, shift


def ape_rows(rows: Rows, module_segments: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(module rows, new-text rows) of a prompt, as [n] bool masks."""
    context = torch.tensor([s in module_segments for s in rows.segment_of])
    queries = torch.tensor([s is None for s in rows.segment_of])
    return context, queries


@torch.inference_mode()
def first_token_logprobs(model, rows: Rows, mask: torch.Tensor, positions: list[int]) -> torch.Tensor:
    out = model(input_ids=torch.tensor([rows.token_ids]), position_ids=torch.tensor([positions]),
                attention_mask=mask, use_cache=False, logits_to_keep=1)
    return torch.log_softmax(out.logits[0, -1].float(), dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, required=True, help="an fp32 fidelity run's .answers.jsonl")
    parser.add_argument("--per-task", type=int, default=200)
    parser.add_argument("--tasks", nargs="+", default=["fact_qa", "ruler"])
    parser.add_argument("--tune-per-task", type=int, default=10)
    parser.add_argument("--tune-seed", type=int, default=1)
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.6, 0.8, 1.0])
    parser.add_argument("--scales", nargs="+", type=float, default=[0.8, 1.0])
    parser.add_argument("--realign", nargs="+", type=int, choices=[0, 1], default=[0, 1],
                        help="tune with (1) and/or without (0) position re-alignment")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "fidelity_ape.jsonl")
    args = parser.parse_args()
    setup(args.threads)
    loaded = load_model(ModelConfig(dtype="float32"))
    AttentionInterface.register(ATTENTION, _ape_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model = loaded.model
    ape.inv_freq = model.model.rotary_emb.inv_freq
    eos = set(loaded.eos_token_ids)

    def prepared(per_task: int, seed: int) -> list:
        eval_set = build_eval_set(per_task=per_task, seed=seed)
        runtime = ModelRuntime(loaded, build_store(StoreConfig()))  # the PML planner only
        for text in eval_set.schemas.values():
            runtime.add_schema(runtime.parse_schema(text), encode=False)
        out = []
        for item in eval_set.items:
            plan = runtime.plan(item.prompt)
            rows = rows_of(plan)
            modules = {c.segment.segment_id for c in plan.cached if c.segment.owner}
            out.append((item, rows, *ape_rows(rows, modules)))
        model.set_attn_implementation(ATTENTION)  # the runtime installed its own attention function
        return out

    # 1. Label-free tuning on held-out prompts: first-token KL from a contiguous full prefill.
    tune = [p for p in prepared(args.tune_per_task, args.tune_seed) if p[0].task in args.tasks]
    grid = [(bool(r), t, s) for r in args.realign for t in args.temperatures for s in args.scales]
    kl: dict[tuple[bool, float, float], list[float]] = {point: [] for point in grid}
    for index, (_, rows, context, queries) in enumerate(tune):
        n = len(rows.token_ids)
        ape.context = None
        full = first_token_logprobs(model, rows, torch.ones((n, n), dtype=torch.bool).tril()[None, None],
                                    list(range(n)))
        ape.context, ape.queries = context, queries
        for point in grid:
            positions, ape.shift = realigned_positions(rows) if point[0] else (rows.positions, None)
            ape.temperature, ape.scale = point[1:]
            mine = first_token_logprobs(model, rows, mask_of(rows, set()), positions)
            kl[point].append(float((full.exp() * (full - mine)).sum()))
        if index % 10 == 0:
            log(f"tune {index}/{len(tune)}")
    for point in grid:
        emit({"bench": "fidelity_ape_tune", "realign": point[0], "temperature": point[1], "scale": point[2],
              "num_prompts": len(tune),
              "seed": args.tune_seed, "mean_first_token_kl": round(statistics.mean(kl[point]), 4)}, args.out)
    best = min(grid, key=lambda point: statistics.mean(kl[point]))
    log(f"lowest KL at realign={best[0]}, T={best[1]}, S={best[2]}")

    # 2. The winner on the evaluation's prompts, paired with the earlier run's fast and full prefill.
    earlier: dict[str, list[dict]] = {}
    for line in args.against.read_text().splitlines():
        row = json.loads(line)
        earlier.setdefault(row["mode"], []).append(row)
    evaluation = prepared(args.per_task, 0)
    if any(len(earlier[m]) != len(evaluation) for m in ("fast", "full_prefill")):
        raise SystemExit(f"{args.against} was not run on this eval set (--per-task {args.per_task})")
    realign, (ape.temperature, ape.scale) = best[0], best[1:]
    label = f"ape:{best[1]}:{best[2]}" + (":realign" if realign else "")
    answers = args.out.with_suffix(".answers.jsonl").open("w")
    for task in args.tasks:
        picked = [(i, p) for i, p in enumerate(evaluation) if p[0].task == task]
        correct = []
        for count, (i, (item, rows, context, queries)) in enumerate(picked):
            assert earlier["fast"][i]["meta"] == item.meta, "the runs must use the same eval set"
            positions, shift = realigned_positions(rows) if realign else (rows.positions, None)
            ape.context, ape.queries, ape.shift = context, queries, shift
            generated = generate(model, rows, mask_of(rows, set()), positions, eos,
                                 len(positions) if realign else None)
            text = loaded.tokenizer.decode(generated, skip_special_tokens=True)
            correct.append(score(text, item))
            answers.write(json.dumps({"mode": label, "task": task, "meta": item.meta,
                                      "text": text, "correct": correct[-1]}) + "\n")
            if count % 20 == 0:
                log(f"{task} {count}/{len(picked)}")
        record = {"bench": "fidelity_ape", "task": task, "variant": label, "realign": realign,
                  "temperature": best[1], "scale": best[2],
                  "num_prompts": len(picked), "accuracy": round(100 * sum(correct) / len(correct), 1),
                  "ci95": [round(x, 1) for x in wilson(sum(correct), len(correct))]}
        for mode in ("fast", "full_prefill"):
            then = [earlier[mode][i]["correct"] for i, _ in picked]
            diffs = [int(a) - int(b) for a, b in zip(correct, then)]
            mean, low, high = paired_difference(diffs)
            record[f"{mode}_accuracy"] = round(100 * sum(then) / len(then), 1)
            record[f"diff_vs_{mode}_points"] = mean
            record[f"diff_vs_{mode}_ci95"] = [low, high]
        record["percent_of_full_prefill"] = round(100 * record["accuracy"] / record["full_prefill_accuracy"], 1)
        emit(record, args.out)
    answers.close()
    ape.context = None


if __name__ == "__main__":
    main()

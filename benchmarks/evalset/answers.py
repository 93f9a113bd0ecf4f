"""Answers to the evaluation's prompts: the in-process full-prefill reference and a server's, over HTTP."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from benchmarks.evalset.tasks import EvalItem, EvalSet
from benchmarks.harness import log
from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import LoadedModel, ModelRuntime
from promptcache.model_runtime.baseline import full_prefill_generate

GENERATE = 32  # default: a 7-digit answer after a short preamble needs more than 16 tokens
AGREE = 16     # greedy agreement is judged on the first 16 tokens
TOP = 20


@dataclass
class Answer:
    """One prompt answered by one mode."""

    text: str
    token_ids: list[int]
    first_top: dict[int, float]   # first token: id -> logprob (top-20), or the full distribution
    recomputed: int = 0
    reused_module_tokens: int = 0


@dataclass(frozen=True)
class Mode:
    """A request's fidelity fields: "mode[:k][@positions][/context]"; what a spec leaves out is the
    server's default (not sent)."""

    spec: str
    mode: str
    head_tokens: int | None = None
    positions: str | None = None
    context: str | None = None

    @classmethod
    def parse(cls, spec: str) -> Mode:
        rest, _, context = spec.partition("/")
        rest, _, positions = rest.partition("@")
        mode, _, k = rest.partition(":")
        return cls(spec, mode, int(k) if k else None, positions or None, context or None)

    def fields(self) -> dict:
        named = {"fidelity_head_tokens": self.head_tokens, "fidelity_positions": self.positions,
                 "fidelity_context": self.context}
        return {"fidelity": self.mode, **{key: value for key, value in named.items() if value is not None}}


def until_eos(token_ids: list[int], eos_ids) -> list[int]:
    for i, token in enumerate(token_ids):
        if token in eos_ids:
            return list(token_ids[:i])
    return list(token_ids)


def reference_answers(loaded: LoadedModel, eval_set: EvalSet, items: list[EvalItem], *,
                      max_tokens: int = GENERATE) -> list[Answer]:
    """Plain full prefill of every prompt's tokens at positions 0..n-1 with Hugging Face transformers (no
    promptcache code on the path but the PML parser that turns the prompt into tokens), greedy."""
    runtime = ModelRuntime(loaded, build_store(StoreConfig()))
    for text in eval_set.schemas.values():
        runtime.add_schema(runtime.parse_schema(text), encode=False)
    answers = []
    for index, item in enumerate(items):
        tokens = runtime.plan(item.prompt).token_ids()
        generated, first_logits = full_prefill_generate(loaded.model, tokens, list(range(len(tokens))), max_tokens,
                                                        loaded.eos_token_ids)
        logprobs = torch.log_softmax(first_logits, dim=-1)
        generated = until_eos(generated, loaded.eos_token_ids)
        text = loaded.tokenizer.decode(generated, skip_special_tokens=True)
        answers.append(Answer(text, generated, dict(enumerate(logprobs.tolist()))))
        if index % 50 == 0:
            log(f"reference {index}/{len(items)}")
    return answers


def cached_references(path: Path | None, items: list[EvalItem], compute) -> list[Answer]:
    """`compute()`'s answers, loaded from `path` when it holds answers to these very prompts."""
    prompts = [item.prompt for item in items]
    if path is not None and path.exists():
        saved = torch.load(path)
        if saved["prompts"] == prompts:
            log(f"reference: loaded from {path}")
            return [Answer(text, ids, dict(enumerate(logprobs.tolist())))
                    for text, ids, logprobs in zip(saved["texts"], saved["token_ids"], saved["first_logprobs"])]
    log("reference: full prefill in-process")
    answers = compute()
    if path is not None:
        first = torch.stack([torch.tensor([a.first_top[i] for i in range(len(a.first_top))]) for a in answers])
        torch.save({"prompts": prompts, "texts": [a.text for a in answers],
                    "token_ids": [a.token_ids for a in answers], "first_logprobs": first}, path)
    return answers


def stored_references(path: Path, items: list[EvalItem], tokenizer) -> list[Answer]:
    """The full-prefill answers an earlier run kept in `path` (its .answers.jsonl) for these very items (the
    same prompts in the same order: checked by their meta). The reference is deterministic (greedy, same
    weights and dtype), so its text is reused as is; its token ids are the text re-tokenized and its
    first-token distribution is unknown (no KL)."""
    rows = [row for line in path.read_text().splitlines() if (row := json.loads(line))["mode"] == "full_prefill"]
    assert len(rows) == len(items), f"{path} holds {len(rows)} full-prefill answers, not {len(items)}"
    answers = []
    for row, item in zip(rows, items):
        meta = {key: value for key, value in item.meta.items() if key != "seed"}
        assert row["task"] == item.task and row["meta"] == meta, f"{path} answered other prompts"
        answers.append(Answer(row["text"], tokenizer.encode(row["text"], add_special_tokens=False), {}))
    return answers


def mode_answers(url: str, items: list[EvalItem], mode: Mode, *, concurrency: int, eos_ids: set[int],
                 max_tokens: int = GENERATE) -> list[Answer]:
    """Every item answered by the server at `url` in `mode`, `concurrency` requests at a time, greedy."""
    client = httpx.Client(timeout=1800)

    def ask(item: EvalItem) -> Answer:
        body = {"prompt": item.prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": TOP, **mode.fields()}
        # The mode's recompute, from explain: the response counts only what the request recomputed itself,
        # and prompts sharing a prefix (the TTFT phase's, or each other's) reuse recomputed blocks.
        explained = client.post(url + "/v1/prompts/explain", json={"prompt": item.prompt, **mode.fields()})
        explained.raise_for_status()
        response = client.post(url + "/v1/generate", json=body)
        response.raise_for_status()
        data = response.json()
        logprobs = data["choices"][0]["logprobs"]
        token_ids = until_eos(logprobs["token_ids"], eos_ids)
        first = dict(zip(logprobs["top_token_ids"][0], logprobs["top_token_logprobs"][0]))
        reused = sum(m["num_tokens"] for m in data["cache"]["modules"])
        return Answer(data["choices"][0]["text"], token_ids, first, explained.json()["recomputed_tokens"], reused)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(ask, items))

"""The per-sequence sampler that picked tokens before a step's rows were sampled together, kept as a reference:
tests compare the batched sampler with it (same tokens for the same seed, same scores) and count its host syncs."""

from __future__ import annotations

import torch

from promptcache.model_runtime.sampling import PromptTokens, SamplingParams


def reference_logprobs(logits: torch.Tensor, token: int, num_top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """`logits`: [vocab]. The log-softmax of the raw logits at `token` and its `num_top` largest (the old code)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [vocab]
    top = torch.topk(logprobs, num_top)
    return float(logprobs[token]), tuple(zip(top.indices.tolist(), top.values.tolist()))


class ReferenceSampler:
    """The per-sequence sampler the engine used before sampling ran batched (kept verbatim as the oracle): one
    row at a time, a host check and a CPU multinomial per sampled row."""

    def __init__(self, params: SamplingParams, *, seed_offset: int = 0, prompt: PromptTokens | None = None) -> None:
        self.params = params
        self.generator = None if params.seed is None else torch.Generator().manual_seed(params.seed + seed_offset)
        self.prompt = prompt if params.uses_prompt_tokens else None
        self._counts: torch.Tensor | None = None  # [vocab] float32: times each token was generated
        self._unseen: list[int] = []  # recorded tokens not yet added to _counts
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        if params.logit_bias:
            self._bias = (torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long),      # [num_biased]
                          torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32))  # [num_biased]

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] -> scores [vocab] float32 (-inf: excluded) in SamplingParams' order. Records nothing."""
        params = self.params
        scores = logits.float().clone()  # [vocab]
        if self._bias is not None:
            ids, values = self._bias
            scores.index_add_(0, ids.to(scores.device), values.to(scores.device))
        if params.repetition_penalty != 1.0:  # HF: every id anywhere in prompt + generated, once
            seen = self._generated_counts(scores) > 0  # [vocab] bool
            if self.prompt is not None:
                seen = seen | self.prompt.mask(scores.numel(), scores.device)
            penalty = params.repetition_penalty
            scores = torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
        if params.presence_penalty or params.frequency_penalty:  # OpenAI: generated tokens only
            counts = self._generated_counts(scores)
            scores = scores - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
        if params.temperature == 0:
            return scores
        scores = scores / params.temperature
        if params.top_k > 0:
            kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:  # HF: drop the lowest tokens whose total mass is at most 1 - top_p
            ascending, order = torch.sort(scores)
            drop = torch.softmax(ascending, dim=-1).cumsum(dim=-1) <= 1 - params.top_p
            drop[-1] = False  # the most likely token always stays
            scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        if params.min_p > 0:
            probs = torch.softmax(scores, dim=-1)
            scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
        return scores

    def sample(self, logits: torch.Tensor) -> int:
        """`logits`: [vocab] float. Returns a token id and records it in the history."""
        scores = self.scores(logits)
        if self.params.is_greedy:
            token = int(torch.argmax(scores))
        else:
            probs = torch.softmax(scores, dim=-1)
            if not bool(torch.isfinite(probs).all()):
                raise FloatingPointError("the sampling distribution is not finite (non-finite logits)")
            token = int(torch.multinomial(probs.cpu(), 1, generator=self.generator))
        self.record(token)
        return token

    def take(self, token_id: int) -> int:
        """Record `token_id`, the argmax computed elsewhere for plain greedy params, and return it."""
        assert self.params.is_plain_greedy, "only plain greedy sampling takes a precomputed argmax"
        self.record(token_id)
        return token_id

    def record(self, token_id: int) -> None:
        """Add a generated token to the history the penalties read (`sample` records its own picks)."""
        if self.params.uses_history:
            self._unseen.append(token_id)

    def _generated_counts(self, scores: torch.Tensor) -> torch.Tensor:
        """[vocab] float32 counts of the generated tokens, brought up to date with what was recorded."""
        if self._counts is None:
            self._counts = torch.zeros(scores.numel(), dtype=torch.float32, device=scores.device)  # [vocab]
        elif self._counts.device != scores.device:
            self._counts = self._counts.to(scores.device)
        if self._unseen:
            ids = torch.tensor(self._unseen, dtype=torch.long, device=self._counts.device)  # [num_unseen]
            self._counts.index_add_(0, ids, torch.ones(len(self._unseen), device=self._counts.device))
            self._unseen.clear()
        return self._counts


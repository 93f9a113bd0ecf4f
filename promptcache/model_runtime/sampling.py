"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, min-p, penalties, logit bias,
seeded (Hugging Face generation semantics)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from promptcache.model_runtime.errors import require

MAX_LOGPROBS = 20
MIN_TEMPERATURE = 1e-3  # below this (but above 0) logits / temperature overflows: use 0 for greedy
MAX_SEED = 2**63 - 1


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The sampled token's log-probability under the model's distribution (before temperature, top-k
    or top-p) and the `logprobs` most likely tokens with theirs, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, token: int, num_top: int) -> TokenLogprobs:
    """`logits`: [vocab]. The log-softmax of the raw logits at `token` and its `num_top` largest."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [vocab]
    top = torch.topk(logprobs, num_top)
    return TokenLogprobs(float(logprobs[token]), tuple(zip(top.indices.tolist(), top.values.tolist())))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens (`temperature == 0`: greedy; `n` samples share the prompt's KV), in HF's order: `logit_bias`,
    `repetition_penalty`, OpenAI's presence/frequency penalties, then temperature, top-k/p, min-p."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # report each sampled token's logprob and this many top alternatives
    # Report each prompt token's logprob (given the tokens before it) and this many alternatives. The
    # prompt is then computed in full: reused KV carries no logits.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        require(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        require(not (self.temperature < 0 or 0 < self.temperature < MIN_TEMPERATURE),
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {self.temperature}")
        require(self.seed is None or 0 <= self.seed <= MAX_SEED, f"seed must be in [0, 2^63 - 1], got {self.seed}")
        require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        require(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        require(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            require(-2 <= getattr(self, name) <= 2, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        require(0 < self.repetition_penalty <= 10,
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            require(token >= 0, f"logit_bias token ids must be >= 0, got {token}")
            require(-100 <= bias <= 100, f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        require(self.n >= 1, f"n must be >= 1, got {self.n}")
        require(all(self.stop), "stop strings must be non-empty")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            require(value is None or 0 <= value <= MAX_LOGPROBS, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def is_plain_greedy(self) -> bool:
        """Whether the next token is always the logits' argmax (greedy, and nothing changes the scores)."""
        return self.is_greedy and not self.logit_bias and not self.uses_history

    @property
    def uses_prompt_tokens(self) -> bool:
        """Whether sampling depends on the prompt's token ids (HF's repetition penalty covers them)."""
        return self.repetition_penalty != 1.0

    @property
    def uses_history(self) -> bool:
        """Whether sampling depends on the tokens generated so far (any penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0


class PromptTokens:
    """A prompt's token ids as `repetition_penalty` reads them: a [vocab] mask built on first use, shared by the
    request's samples, on the device last asked for (cached CPU logits, then the model's)."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self._token_ids = torch.tensor(list(token_ids), dtype=torch.long)  # [num_prompt_tokens]
        self._mask: torch.Tensor | None = None

    def mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[vocab_size] bool: True at every id that occurs in the prompt (reused or computed)."""
        if self._mask is None:
            self._mask = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, self._token_ids, True)  # [vocab]
        if self._mask.device != torch.device(device):
            self._mask = self._mask.to(device)
        return self._mask


class Sampler:
    """Picks one sequence's next token from logits (whose device may change between calls). Owns the RNG and the
    generated-token counts; without `prompt`, `repetition_penalty` covers the generated tokens only."""

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


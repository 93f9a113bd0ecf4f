"""Sampling parameters (Hugging Face generation semantics) and the logprobs reported with a token."""

from __future__ import annotations

from dataclasses import dataclass

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

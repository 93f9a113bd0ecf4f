"""Typed responses of the promptcache API (extra fields from newer servers are kept, not rejected)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class FidelityModeStats(_Model):
    """One fidelity mode against a full prefill of the same prompts, first token only."""

    num_samples: int
    top1_agreement: float  # fraction of samples whose greedy first token is the full prefill's
    agreement_ci95: tuple[float, float]  # 95 % Wilson interval
    mean_kl: float  # nats; over both top-20 lists plus the rest of the vocabulary: a lower bound
    max_kl: float


class FidelitySampleResult(_Model):
    top1_agrees: bool
    kl: float


class FidelitySample(_Model):
    module_paths: list[str]
    prompt: str
    prompt_tokens: int
    exact: bool  # the prompt served from cache as encoded equals a full prefill
    modes: dict[str, FidelitySampleResult]


class FidelityReport(_Model):
    """How far each fidelity mode's first token is from a full prefill's, on sampled prompts of a schema."""

    schema_name: str = Field(alias="schema")
    model: str
    num_samples: int
    seed: int
    question: str
    max_imports: int | None = None
    fidelity_head_tokens: int
    fidelity_positions: str
    fidelity_context: str
    modes: dict[str, FidelityModeStats]  # exact, fast, balanced
    samples: list[FidelitySample]
    elapsed_ms: float
    cached: bool = False


class ModuleInfo(_Model):
    name: str
    path: str
    start: int
    end: int
    num_tokens: int
    role: str | None = None  # the top-level role section holding it: system | user | assistant


class SchemaInfo(_Model):
    name: str
    num_tokens: int
    modules: list[ModuleInfo]
    encode_ms: float | None = None
    scaffolds: list[list[str]] = Field(default_factory=list)  # module paths encoded jointly
    always_included: list[tuple[int, int]] = Field(default_factory=list)  # [start, end) in every prompt
    fidelity_report: FidelityReport | None = None  # on an upload that asked for it
    fidelity_report_error: str | None = None  # why that report failed (the schema is uploaded)


class Choice(_Model):
    index: int
    text: str
    finish_reason: str | None = None


class Usage(_Model):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    total_tokens: int


class ModuleReport(_Model):
    path: str
    num_tokens: int
    tier: str | None = None
    recomputed_tokens: int = 0
    encoded_after: str | None = None  # the module its reused KV was encoded after (fidelity context predecessor)


class PrefixReport(_Model):
    """Prompt tokens reused from automatic prefix blocks, by tier."""

    num_tokens: int
    num_blocks: int
    tiers: dict[str, int] = Field(default_factory=dict)


class PromptSpan(_Model):
    """Prompt tokens at consecutive layout positions whose KV came from one place (`return_spans=True`)."""

    start: int
    num_tokens: int
    origin: Literal["module", "prefix", "recomputed", "computed"]
    module: str | None = None
    tier: str | None = None
    text: str


class CacheReport(_Model):
    exact: bool
    modules: list[ModuleReport]
    # The server opened the assistant turn after the prompt's last turn (add_generation_prompt); false when
    # the prompt ended in an open <assistant> turn.
    generation_prompt_added: bool = False
    approximations: list[str] = Field(default_factory=list)
    fidelity: str | None = None  # the mode that ran: fast | balanced | exact
    positions: str | None = None  # where the tokens sat: layout | contiguous (reused keys re-aligned)
    context: str | None = None  # which encoding out-of-context modules reused: schema | predecessor
    recomputed_tokens: int = 0
    prefix: PrefixReport | None = None
    spans: list[PromptSpan] | None = None  # only when the request asked for them


class Timings(_Model):
    ttft_ms: float
    total_ms: float | None = None


class Generation(_Model):
    id: str
    choices: list[Choice]
    usage: Usage
    cache: CacheReport
    timings: Timings

    @property
    def text(self) -> str:
        """The first choice's text."""
        return self.choices[0].text


class GenerationChunk(_Model):
    id: str
    choices: list[Choice]
    usage: Usage | None = None
    cache: CacheReport | None = None
    timings: Timings | None = None


class Explanation(_Model):
    schema_name: str = Field(alias="schema")
    exact: bool
    generation_prompt_added: bool = False  # as in CacheReport
    approximations: list[str]
    modules: list[ModuleReport]
    prompt_tokens: int
    cached_tokens: int
    tokens_to_compute: int

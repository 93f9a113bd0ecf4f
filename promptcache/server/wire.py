"""Wire models of the promptcache REST API (pydantic). Only the server uses them."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)

MIN_TEMPERATURE = 1e-3  # model_runtime.sampling refuses smaller non-zero temperatures too
MAX_STOP_STRINGS, MAX_STOP_CHARS = 8, 256
CACHE_SALT_PATTERN = r"^[^\x00-\x1f]*$"  # no control characters: server-derived tenant salts use them


MAX_LOGIT_BIAS = 1024


def at_most(max_items: int) -> BeforeValidator:
    """Refuses a list or dict of more than `max_items` items before any item is validated: pydantic's `max_length`
    is checked after every item (2 MiB of `[1],` cost seconds of validation before its 422)."""

    def check(value: Any) -> Any:
        if isinstance(value, (list, dict)) and len(value) > max_items:
            raise ValueError(f"at most {max_items} items, got {len(value)}")
        return value

    return BeforeValidator(check)


class StrictModel(BaseModel):
    """A request model: an unknown field is refused (a feature this server does not have), never ignored."""

    model_config = ConfigDict(extra="forbid")


class FidelityKnobs(StrictModel):
    fidelity_head_tokens: int | None = Field(None, ge=0, le=4096, description="balanced: tokens recomputed at the "
                                             "start of each out-of-context module")
    fidelity_positions: Literal["contiguous", "layout"] | None = Field(None, description="fast/balanced: contiguous "
                                                                       "(reused keys re-aligned) or layout positions")
    fidelity_context: Literal["schema", "predecessor"] | None = Field(None, description="fast/balanced: reuse a "
                                                                      "module's KV encoded after its schema context "
                                                                      "or also after the module before it")


class PromptOptions(FidelityKnobs):
    cache_salt: str | None = Field(None, max_length=256, pattern=CACHE_SALT_PATTERN)
    fidelity: Literal["fast", "balanced", "exact"] | None = Field(None, description="how module KV reused outside "
                                                                  "its encoding context is treated")


class FidelityReportQuery(FidelityKnobs):
    """What a schema's fidelity report samples and how its modes run (GET /v1/schemas/{name}/fidelity's query, or
    the upload's `fidelity_report` object); unset fields take the report's and server's defaults."""

    num_samples: int = Field(16, ge=1, description="distinct module combinations to sample (the server caps it)")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="the same seed samples the same combinations")
    question: str | None = Field(None, max_length=2000, description="asked after the modules ('': none)")
    max_imports: int | None = Field(None, ge=1, description="at most this many top-level modules per combination")


class FidelityModeStats(BaseModel):
    """One fidelity mode against a full prefill of the same prompts, first token only."""

    num_samples: int
    top1_agreement: float = Field(description="fraction of samples whose greedy first token is the full prefill's")
    agreement_ci95: tuple[float, float] = Field(description="95 % Wilson interval of top1_agreement")
    mean_kl: float = Field(description="mean first-token KL(full prefill || mode), in nats, over the tokens in "
                                       "both top-20 lists plus one bucket for the rest: a lower bound")
    max_kl: float


class FidelitySampleResult(BaseModel):
    top1_agrees: bool
    kl: float


class FidelitySample(BaseModel):
    """One sampled combination: the modules the prompt imports (union defaults included) and each mode's result."""

    module_paths: list[str]
    prompt: str
    prompt_tokens: int
    exact: bool = Field(description="served from cache as encoded, the prompt equals a full prefill")
    modes: dict[str, FidelitySampleResult]


class FidelityReport(BaseModel):
    """How far each fidelity mode's first token is from a full prefill's, on sampled prompts of one schema."""

    object: Literal["fidelity_report"] = "fidelity_report"
    schema_name: str = Field(..., alias="schema")
    model: str
    num_samples: int
    seed: int
    question: str
    max_imports: int | None = None
    fidelity_head_tokens: int
    fidelity_positions: str
    fidelity_context: str
    modes: dict[str, FidelityModeStats] = Field(description="exact, fast, balanced")
    samples: list[FidelitySample]
    elapsed_ms: float = Field(description="time the report took to compute")
    cached: bool = Field(False, description="served from the report cache of this schema version")

    model_config = ConfigDict(populate_by_name=True)


class SchemaCreate(StrictModel):
    pml: str = Field(description="the <schema> document")
    fidelity_report: bool | FidelityReportQuery = Field(False, description="true (or its options): the response "
                                                        "carries the schema's fidelity report")


class ParamInfo(BaseModel):
    name: str
    start: int
    length: int


class ModuleInfo(BaseModel):
    name: str
    path: str
    start: int
    end: int
    num_tokens: int
    params: list[ParamInfo] = Field(default_factory=list, description="the module's own parameter slots")
    role: Literal["system", "user", "assistant"] | None = Field(None, description="the top-level role section "
                                                                "holding the module (a prompt imports it there)")


class _OmitUnasked(BaseModel):
    """Omits the `UNASKED` fields while None: a request that did not ask for them gets the response it always got."""

    UNASKED: ClassVar[tuple[str, ...]] = ()

    # No return annotation: the response schema stays the model's. (Field(exclude_if=...) needs pydantic 2.11.)
    @model_serializer(mode="wrap")
    def _omit_unasked(self, handler: SerializerFunctionWrapHandler):
        return {key: value for key, value in handler(self).items() if value is not None or key not in self.UNASKED}


class SchemaInfo(_OmitUnasked):
    UNASKED = ("fidelity_report", "fidelity_report_error")
    name: str
    num_tokens: int
    modules: list[ModuleInfo]
    encode_ms: float | None = None
    num_segments: int = 0
    scaffolds: list[list[str]] = Field(default_factory=list)
    always_included: list[tuple[int, int]] = Field(default_factory=list, description="position ranges [start, end) "
                                                   "of the text every prompt includes")
    fidelity_report: FidelityReport | None = Field(None, description="on an upload that asked for it")
    fidelity_report_error: str | None = Field(None, description="why that report failed (the schema is uploaded)")


class SchemaList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SchemaInfo]


class SamplingFields(PromptOptions):
    """Sampling fields shared by /v1/generate and the OpenAI endpoints."""

    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="0 = greedy; otherwise at least 0.001")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top token's probability")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="HF's: over prompt and generated tokens")
    logit_bias: Annotated[dict[str, float], at_most(MAX_LOGIT_BIAS)] | None = Field(
        None, description=f"token id (as a string) -> bias in [-100, 100]; at most {MAX_LOGIT_BIAS} entries")
    n: int = Field(1, ge=1, le=16)
    stop: str | Annotated[list[str], at_most(MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    ignore_eos: bool = Field(False, description="keep generating past the end-of-sequence token (vLLM extension)")

    @field_validator("temperature")
    @classmethod
    def _temperature_floor(cls, value: float) -> float:
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, value):
        for key, bias in (value or {}).items():
            if not key.strip().isdecimal():  # isdigit() would pass '²', which int() refuses
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return value

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most "
                             f"{MAX_STOP_CHARS} characters")
        return value


class GenerateRequest(SamplingFields):
    prompt: str
    logprobs: int | None = Field(None, ge=0, le=20, description="each token's logprob and this many alternatives")
    return_spans: bool = Field(False, description="the prompt as spans by where their KV came from (cache.spans)")


class ExplainRequest(PromptOptions):
    prompt: str


class Logprobs(BaseModel):
    """Per generated token, as OpenAI's completions API shapes them."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    token_ids: list[int] = Field(default_factory=list)
    # The top alternatives by id (token texts may collide in top_logprobs), most likely first.
    top_token_ids: list[list[int]] = Field(default_factory=list)
    top_token_logprobs: list[list[float]] = Field(default_factory=list)


class Choice(BaseModel):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: Logprobs | None = None


class Usage(BaseModel):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    total_tokens: int
    computed_tokens: int | None = None


class ModuleReport(BaseModel):
    path: str
    num_tokens: int = Field(description="tokens of the module's cached KV reused")
    tier: str | None
    recomputed_tokens: int = Field(0, description="tokens of its KV recomputed in their actual context")
    encoded_after: str | None = Field(None, description="the module after which the reused KV was encoded; null: "
                                                        "after its schema context")


class PrefixReport(BaseModel):
    """Prompt tokens reused from automatic prefix blocks, and the tiers they came from."""

    num_tokens: int
    num_blocks: int
    tiers: dict[str, int] = Field(default_factory=dict, description="tokens per tier")


class PromptSpanReport(BaseModel):
    """Prompt tokens at consecutive positions whose KV came from one place (request `return_spans`)."""

    start: int = Field(description="position of the span's first token in the schema layout")
    num_tokens: int
    origin: Literal["module", "prefix", "recomputed", "computed"] = Field(
        description="module: a module's cached KV; prefix: automatic prefix blocks; recomputed: module tokens "
                    "computed in their actual context (balanced / exact); computed: computed now")
    module: str | None = Field(None, description="the module path the tokens belong to, if any")
    tier: str | None = Field(None, description="where reused KV came from: device | host | redis | disk")
    text: str = Field(description="the span's tokens decoded (the texts in order make the prompt text)")


class ReuseReport(BaseModel):
    """What a prompt reuses (from which tier) and computes: /v1/generate's `cache`, /v1/prompts/explain's base."""

    exact: bool
    generation_prompt_added: bool = Field(False, description="the server opened the assistant turn after the "
                                          "prompt's last turn, as add_generation_prompt does")
    fidelity: str = Field("fast", description="the fidelity mode that ran: fast | balanced | exact")
    positions: str = Field("layout", description="where the prompt's tokens sat: layout | contiguous")
    context: str = Field("schema", description="which encoding of out-of-context modules was reused: schema | "
                                               "predecessor")
    recomputed_tokens: int = 0
    approximations: list[str] = Field(default_factory=list)
    modules: list[ModuleReport]
    prefix: PrefixReport | None = None


class CacheReport(ReuseReport, _OmitUnasked):
    UNASKED = ("spans",)
    spans: list[PromptSpanReport] | None = Field(None, description="every prompt token once, in position order")


class Timings(BaseModel):
    ttft_ms: float
    total_ms: float
    encode_ms: float = 0.0
    assembly_ms: float = 0.0
    lookup_ms: float = Field(0.0, description="looking up automatic prefix blocks (part of assembly_ms)")
    prefill_ms: float = 0.0


class GenerateResponse(BaseModel):
    id: str
    object: Literal["generation"] = "generation"
    model: str
    choices: list[Choice]
    usage: Usage
    cache: CacheReport
    timings: Timings


class GenerateChunk(BaseModel):
    id: str
    object: Literal["generation.chunk"] = "generation.chunk"
    model: str
    choices: list[Choice]
    usage: Usage | None = None
    cache: CacheReport | None = None
    timings: Timings | None = None


class Explanation(ReuseReport):
    schema_name: str = Field(..., alias="schema")
    prompt_tokens: int
    cached_tokens: int
    tokens_to_compute: int

    model_config = ConfigDict(populate_by_name=True)

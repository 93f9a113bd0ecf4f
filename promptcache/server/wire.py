"""Wire models of the promptcache REST API (pydantic). Only the server uses them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SchemaCreate(_Strict):
    pml: str = Field(..., description="the <schema> document")


class ModuleInfo(BaseModel):
    name: str
    path: str
    start: int
    end: int
    num_tokens: int


class SchemaInfo(BaseModel):
    name: str
    num_tokens: int
    modules: list[ModuleInfo]
    encode_ms: float | None = None
    num_segments: int = 0
    scaffolds: list[list[str]] = Field(default_factory=list)


class SchemaList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SchemaInfo]


class SamplingFields(BaseModel):
    """Sampling fields shared by /v1/generate and the OpenAI endpoints."""

    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    cache_salt: str | None = Field(None, max_length=256)


class GenerateRequest(SamplingFields):
    model_config = ConfigDict(extra="forbid")
    prompt: str


class ExplainRequest(_Strict):
    prompt: str
    cache_salt: str | None = Field(None, max_length=256)


class Choice(BaseModel):
    index: int
    text: str
    finish_reason: str | None = None


class Usage(BaseModel):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    total_tokens: int
    computed_tokens: int | None = None


class ModuleReport(BaseModel):
    path: str
    num_tokens: int
    tier: str | None


class CacheReport(BaseModel):
    exact: bool
    approximations: list[str] = Field(default_factory=list)
    modules: list[ModuleReport]


class Timings(BaseModel):
    ttft_ms: float
    total_ms: float
    encode_ms: float = 0.0
    assembly_ms: float = 0.0
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


class Explanation(BaseModel):
    schema_name: str = Field(..., alias="schema")
    exact: bool
    approximations: list[str]
    modules: list[ModuleReport]
    prompt_tokens: int
    cached_tokens: int
    tokens_to_compute: int

    model_config = ConfigDict(populate_by_name=True)


class ErrorBody(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody

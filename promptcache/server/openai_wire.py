"""Wire models of the OpenAI-compatible endpoints (fields OpenAI clients send, with our extensions)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from promptcache.server.wire import SamplingFields


class StreamOptions(BaseModel):
    include_usage: bool = False


class _OpenAIFields(SamplingFields):
    model_config = ConfigDict(extra="ignore")  # clients send informational fields (user, metadata, ...)

    model: str | None = None
    max_tokens: int = Field(16, ge=1)
    stream_options: StreamOptions | None = None
    # Accepted only at their neutral values; anything else is refused (never silently ignored).
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None


class CompletionRequest(_OpenAIFields):
    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_OpenAIFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    schema_name: str | None = Field(None, alias="schema", description="PML schema whose modules messages import")
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

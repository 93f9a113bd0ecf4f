"""promptcache Python SDK: sync and async clients, streaming, PML builder, @prompt programs.
Imports only httpx and pydantic (the base install of `promptcache` is this SDK)."""

from promptcache.clients.async_client import AsyncClient
from promptcache.clients.base import AsyncStream, Stream
from promptcache.clients.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    PromptCacheError,
    RateLimitError,
    ServiceUnavailableError,
    UnprocessableEntityError,
)
from promptcache.clients.pml_builder import (
    Assistant,
    AssistantTurn,
    Import,
    Module,
    Param,
    Prompt,
    PromptProgram,
    Recorder,
    Scaffold,
    Schema,
    System,
    Union,
    User,
    prompt,
)
from promptcache.clients.sync_client import Client
from promptcache.clients.types import (
    CacheReport,
    Choice,
    Explanation,
    FidelityModeStats,
    FidelityReport,
    FidelitySample,
    Generation,
    GenerationChunk,
    ModuleInfo,
    ModuleReport,
    PrefixReport,
    PromptSpan,
    SchemaInfo,
    Timings,
    Usage,
)

__all__ = ["APIConnectionError", "APIStatusError", "APITimeoutError", "Assistant", "AssistantTurn", "AsyncClient",
           "AsyncStream", "AuthenticationError", "BadRequestError", "CacheReport", "Choice", "Client", "ConflictError",
           "Explanation", "FidelityModeStats", "FidelityReport", "FidelitySample", "Generation", "GenerationChunk",
           "Import", "InternalServerError", "Module", "ModuleInfo", "ModuleReport", "NotFoundError", "Param",
           "PayloadTooLargeError", "PrefixReport", "Prompt", "PromptSpan", "PromptCacheError", "PromptProgram",
           "RateLimitError", "Recorder", "Scaffold", "Schema", "SchemaInfo", "ServiceUnavailableError", "Stream",
           "System", "Timings", "Union", "UnprocessableEntityError", "Usage", "User", "prompt"]

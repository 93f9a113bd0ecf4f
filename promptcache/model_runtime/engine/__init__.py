"""The batched decode engine: continuous batching with shared-module attention."""

from promptcache.model_runtime.engine.config import EngineConfig
from promptcache.model_runtime.engine.engine import Engine
from promptcache.model_runtime.engine.request import ErrorKind, FinishReason, RequestReport, TokenEvent
from promptcache.model_runtime.engine.reuse_plan import Fidelity, ReusePlan, resolve

__all__ = [
    "Engine", "EngineConfig", "ErrorKind", "Fidelity", "FinishReason", "RequestReport", "ReusePlan", "TokenEvent",
    "resolve",
]

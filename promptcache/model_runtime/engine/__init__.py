"""The batched decode engine: continuous batching with shared-module attention."""

from promptcache.model_runtime.engine.config import EngineConfig
from promptcache.model_runtime.engine.engine import Engine
from promptcache.model_runtime.engine.request import TokenEvent

__all__ = ["Engine", "EngineConfig", "TokenEvent"]

"""Model runtime: loading HF causal LMs, module encoding, the batched engine (the only package that imports
torch/transformers)."""

from promptcache.model_runtime.engine import EngineConfig, ErrorKind, Fidelity, FinishReason, RequestReport, TokenEvent
from promptcache.model_runtime.engine.reuse_plan import ContextMode, FidelityMode, PositionMode
from promptcache.model_runtime.errors import (
    ChatRenderError,
    EngineError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    QueueFullError,
    UnsupportedModelError,
)
from promptcache.model_runtime.facade import ModelRuntime, PromptRuntime, RuntimeStats
from promptcache.model_runtime.intraop_threads import confine_to_this_thread, confined_executor, run_in_passing_thread
from promptcache.model_runtime.loading.architectures import SUPPORTED_ARCHITECTURES
from promptcache.model_runtime.loading.loader import LoadedModel, ModelConfig, load_model, wrap_model
from promptcache.model_runtime.loading.quantized_linear import WeightFormat
from promptcache.model_runtime.module_encoder import EncodeReport, ModuleEncoder
from promptcache.model_runtime.results import CacheReport, ModuleUse, PrefixUse, Timings, Usage
from promptcache.model_runtime.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprobs

__all__ = [
    "MAX_LOGPROBS", "SUPPORTED_ARCHITECTURES", "CacheReport", "ChatRenderError", "ContextMode", "EncodeReport",
    "EngineConfig", "EngineError", "ErrorKind", "Fidelity", "FidelityMode", "FinishReason", "InvalidRequestError",
    "LoadedModel", "ModelConfig", "ModelLoadError", "ModelRuntime", "ModuleEncoder", "ModuleUse", "PositionMode",
    "PrefixUse", "PromptRuntime", "PromptTooLongError", "QueueFullError", "RequestReport", "RuntimeStats",
    "SamplingParams", "Timings", "TokenEvent", "TokenLogprobs", "UnsupportedModelError", "Usage", "WeightFormat",
    "confine_to_this_thread", "confined_executor", "load_model", "run_in_passing_thread", "wrap_model",
]

"""Model runtime: loading HF causal LMs, module encoding, cached prefill, generation, batched engine.

The only package that imports torch/transformers.
"""

from promptcache.model_runtime.errors import (
    ChatRenderError,
    EngineError,
    ModelLoadError,
    PromptTooLongError,
    QueueFullError,
    UnsupportedModelError,
)
from promptcache.model_runtime.loader import (
    SUPPORTED_ARCHITECTURES,
    LoadedModel,
    ModelConfig,
    load_model,
    wrap_model,
)
from promptcache.model_runtime.module_encoder import EncodeReport, ModuleEncoder
from promptcache.model_runtime.results import (
    Completion,
    GenerationResult,
    ModuleUse,
    PrefixUse,
    Timings,
    Usage,
)
from promptcache.model_runtime.runtime import ModelRuntime
from promptcache.model_runtime.sampling import SamplingParams

__all__ = [
    "SUPPORTED_ARCHITECTURES", "ChatRenderError", "Completion", "EncodeReport", "EngineError", "GenerationResult", "LoadedModel",
    "ModelConfig", "ModelLoadError", "ModelRuntime", "ModuleEncoder", "ModuleUse", "PrefixUse", "PromptTooLongError",
    "QueueFullError", "SamplingParams", "Timings", "UnsupportedModelError", "Usage", "load_model", "wrap_model",
]

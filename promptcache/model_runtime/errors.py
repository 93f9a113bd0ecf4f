"""The runtime's error tree."""

from __future__ import annotations


class EngineError(Exception):
    """Root of every model-runtime error."""


class ModelLoadError(EngineError):
    """A model or tokenizer could not be loaded."""


class UnsupportedModelError(ModelLoadError):
    """The model's architecture is not one promptcache supports."""


class InvalidRequestError(EngineError):
    """The request itself cannot be served (bad input): a 4xx, never a server fault."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (or its generation) needs positions the model does not have."""


class ChatRenderError(InvalidRequestError):
    """The model's chat template cannot render the given messages (bad input, a 4xx)."""

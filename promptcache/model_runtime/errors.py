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


def require(condition: bool, message: str) -> None:
    """Raise ValueError(`message`) unless `condition` (an argument check)."""
    if not condition:
        raise ValueError(message)


class QueueFullError(EngineError):
    """The caller's tenant has as many requests waiting as the engine queues for one tenant: retry after
    `retry_after_s` seconds (overload, a 429, never a fault of the request)."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

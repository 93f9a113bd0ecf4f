"""The engine's inbox: typed messages its callers post from any thread, taken by the engine thread."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass

from promptcache.model_runtime.engine.request import Request
from promptcache.pml import Schema


@dataclass(frozen=True, slots=True)
class Submit:
    request: Request  # its place in its tenant's queue is reserved


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class EncodeSchema:
    """`Engine.encode_schema`: `future` resolves with its EncodeReport."""

    schema: Schema
    salt: str | None
    owner: str | None
    future: concurrent.futures.Future
    keep_local: bool
    second_encodings: bool


Message = Submit | Abort | EncodeSchema


class Inbox:
    """Messages in posting order. `wakeup` guards them: a test holds it to post several as one batch."""

    def __init__(self) -> None:
        self.wakeup = threading.Condition()
        self._messages: list[Message] = []
        self.is_closed = False

    def post(self, message: Message) -> None:
        with self.wakeup:
            self._messages.append(message)
            self.wakeup.notify()

    def close(self) -> None:
        with self.wakeup:
            self.is_closed = True
            self.wakeup.notify()

    def take(self, is_idle: Callable[[], bool], wait_s: float) -> list[Message] | None:
        """Every message posted since the last take; while there is none and `is_idle()`, waits (checking
        again every `wait_s`). None once closed."""
        with self.wakeup:
            while not self._messages and is_idle() and not self.is_closed:
                self.wakeup.wait(wait_s)
            if self.is_closed:
                return None
            messages, self._messages = self._messages, []
            return messages

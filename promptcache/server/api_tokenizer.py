"""/tokenize and /detokenize in vLLM's shapes: the token ids the completion routes would feed the model."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import Response

from promptcache.server.errors import UnsupportedParameterError
from promptcache.server.json_body import json_off_loop
from promptcache.server.openai.wire import DetokenizeRequest, TokenizeRequest, chat_messages
from promptcache.server.service import PromptService
from promptcache.server.state import Service

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, service: Service) -> Response:
    if (body.prompt is None) == (body.messages is None):
        raise UnsupportedParameterError("send exactly one of prompt or messages")
    if not body.add_special_tokens:
        raise UnsupportedParameterError("add_special_tokens=false is not supported: prompts are tokenized as "
                                        "/v1/completions tokenizes them")
    if not body.add_generation_prompt:
        raise UnsupportedParameterError("add_generation_prompt=false is not supported: chats are rendered as "
                                        "/v1/chat/completions renders them")
    messages = chat_messages(body.messages) if body.messages is not None else None
    return await json_off_loop(lambda: _tokenize(service, body, messages))


def _tokenize(service: PromptService, body: TokenizeRequest, messages: list[dict[str, str]] | None) -> dict:
    """Tokenizing and each token's string: per-token work, run in a worker thread."""
    tokens = service.runtime.tokenize(body.prompt, messages)
    reply: dict = {"count": len(tokens), "max_model_len": service.runtime.max_positions, "tokens": list(tokens)}
    if body.return_token_strs:
        reply["token_strs"] = [service.token_strings.text(t) for t in tokens]
    return reply


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, service: Service) -> dict:
    return {"prompt": await asyncio.to_thread(service.runtime.detokenize, body.tokens)}

"""Wire models of the OpenAI-compatible endpoints (fields OpenAI clients send, with our extensions)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from promptcache.server.errors import InvalidParameterError, UnsupportedParameterError
from promptcache.server.wire import SamplingFields, StrictModel, at_most

MAX_CHAT_MESSAGES = 1024  # a chat's turns; its tokens are bounded by the model's positions after rendering
MAX_CONTENT_PARTS = 32  # one message's content parts
MAX_PROMPTS = 4096  # prompts in one completion request (max_prompts_per_request may allow fewer, never more)
MAX_TOKEN_IDS = 1 << 20  # token ids in one prompt (or one /detokenize list); a model's positions bound it further
MAX_OTHER_ITEMS = 128  # fields OpenAI defines that we accept only empty (tools, functions, modalities, metadata)


def _bounded_prompt(value: Any) -> Any:
    """The completion prompt's list bound by its shape, decided by the first item, before any item is validated:
    token ids (at most MAX_TOKEN_IDS) or texts / token-id lists (at most MAX_PROMPTS)."""
    if isinstance(value, list) and value:
        is_ids = isinstance(value[0], int) and not isinstance(value[0], bool)
        cap = MAX_TOKEN_IDS if is_ids else MAX_PROMPTS
        if len(value) > cap:
            raise ValueError(f"at most {cap} {'token ids' if is_ids else 'prompts'}, got {len(value)}")
    return value


class StreamOptions(StrictModel):
    include_usage: bool = False


class _OpenAIFields(SamplingFields):
    """Every field OpenAI defines for the route; any other is refused with a 400 naming it (extra="forbid"), never
    dropped. Fields we do not implement pass only at values that ask for nothing (`NEUTRAL`)."""

    model: str | None = None
    max_tokens: int = Field(16, ge=1)
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="informational (end-user id); logged, changes nothing")


class CompletionRequest(_OpenAIFields):
    # A text, a list of texts, token ids, or a list of token-id lists: each prompt one group of n choices.
    prompt: Annotated[str | list[str] | list[int] | list[Annotated[list[int], at_most(MAX_TOKEN_IDS)]],
                      BeforeValidator(_bounded_prompt)]
    max_tokens: int = Field(16, ge=0, description="0 only with echo: return the prompt, generate nothing")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice group: a text or token ids each."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(cast("list[str] | list[list[int]]", prompt))
    logprobs: int | None = Field(None, ge=0, le=20, description="each token's logprob and this many alternatives")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[dict[str, Any]], at_most(MAX_CONTENT_PARTS)] | None = None
    name: str | None = None


class ChatCompletionRequest(_OpenAIFields):
    messages: Annotated[list[ChatMessage], at_most(MAX_CHAT_MESSAGES)] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    schema_name: str | None = Field(None, alias="schema", description="PML schema whose modules messages import")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Annotated[list[Any], at_most(MAX_OTHER_ITEMS)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[list[Any], at_most(MAX_OTHER_ITEMS)] | None = None
    function_call: Any = None
    response_format: Annotated[dict[str, Any], at_most(MAX_OTHER_ITEMS)] | None = None
    audio: Any = None
    modalities: Annotated[list[str], at_most(MAX_OTHER_ITEMS)] | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    metadata: Annotated[dict[str, str], at_most(MAX_OTHER_ITEMS)] | None = None
    store: bool | None = None
    service_tier: str | None = None
    web_search_options: Any = None

    model_config = ConfigDict(populate_by_name=True)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Role/content dicts for the chat template: text parts joined, `developer` as `system` (at most MAX_CHAT_MESSAGES:
    the wire models refuse more). Raises UnsupportedParameterError for non-text content parts, InvalidParameterError for
    a text part whose `text` is not a string."""
    rendered = []
    for index, message in enumerate(messages):
        if isinstance(message.content, list) and any(part.get("type") != "text" for part in message.content):
            raise UnsupportedParameterError(f"messages[{index}]: only text content parts are supported")
        for number, part in enumerate(message.content if isinstance(message.content, list) else []):
            if not isinstance(part.get("text"), str):  # joined below: anything else was a TypeError, a 500
                raise InvalidParameterError(f"messages[{index}].content[{number}].text: expected a string, got "
                                            f"{type(part.get('text')).__name__}")
        content = message.content if isinstance(message.content, str) else "".join(
            part.get("text", "") for part in message.content or [] if part.get("type") == "text")
        rendered.append({"role": "system" if message.role == "developer" else message.role, "content": content})
    return rendered


class TokenizeRequest(StrictModel):
    """POST /tokenize (vLLM's shape): exactly one of `prompt` or `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], at_most(MAX_CHAT_MESSAGES)] | None = None
    add_special_tokens: bool = Field(True, description="False is refused: prompts are tokenized as the completion "
                                                       "routes tokenize them")
    add_generation_prompt: bool = Field(True, description="False is refused: chats are rendered for a reply")
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: Annotated[list[int], at_most(MAX_TOKEN_IDS)]


def _no(value: Any) -> bool:
    return not value


# field -> (the values that ask for nothing this server does not do, why other values are refused)
NEUTRAL: dict[str, tuple[Any, str]] = {
    "best_of": (lambda v: v in (None, 1), "best_of > 1 is not supported"),
    "suffix": (_no, "suffix (insertion) is not supported"),
    "tools": (_no, "tools are not supported"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "tool_choice other than none/auto needs tools, "
                                                           "which are not supported"),
    "functions": (_no, "functions are not supported"),
    "function_call": (lambda v: v in (None, "none", "auto"), "function_call needs functions, which are not "
                                                             "supported"),
    "response_format": (lambda v: v is None or v.get("type", "text") == "text",
                        "only response_format type 'text' is supported"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "modalities": (lambda v: v in (None, ["text"]), "only the text modality is supported"),
    "prediction": (lambda v: v is None, "predicted outputs are not supported"),
    "reasoning_effort": (lambda v: v is None, "reasoning_effort is not supported (not a reasoning model)"),
    "store": (lambda v: v in (None, False), "store is not supported (completions are never stored)"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "only service_tier auto/default exists here"),
    "web_search_options": (lambda v: v is None, "web search is not supported"),
}


def is_pml(prompt: str | list[int]) -> bool:
    """A completion prompt that is a PML document (it imports modules); any other text is plain."""
    return isinstance(prompt, str) and prompt.lstrip().startswith("<prompt")


def refuse_unsupported(body: BaseModel) -> None:
    """Raises UnsupportedParameterError naming every field set to a value this server does not do, and why."""
    refused = [(name, NEUTRAL[name][1]) for name in sorted(body.model_fields_set)
               if name in NEUTRAL and not NEUTRAL[name][0](getattr(body, name))]
    if isinstance(body, CompletionRequest):
        if body.echo and body.logprobs is not None and any(is_pml(p) for p in body.prompts()):
            refused.append(("echo", "echo with logprobs takes plain text or token ids (a PML prompt reuses module "
                                    "KV, which carries no logits)"))
        if body.echo and body.stream:
            refused.append(("echo", "echo is not supported with stream"))
        if body.max_tokens == 0 and not body.echo:
            refused.append(("max_tokens", "0 needs echo"))
        if body.stream and len(body.prompts()) > 1:
            refused.append(("prompt", "streaming takes one prompt; send several without stream"))
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            refused.append(("top_logprobs", "needs logprobs: true"))
        refused += [(f"messages[{i}].name", "participant names are not supported")
                    for i, m in enumerate(body.messages) if m.name]
    if refused:
        raise UnsupportedParameterError("; ".join(f"{field}: {reason}" for field, reason in refused))

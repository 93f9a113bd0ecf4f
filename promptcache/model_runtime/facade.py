"""PromptRuntime, what a server talks to (schemas, plans, generation, explain, stats), over ModelRuntime (a model, its
schemas and module encoder). Plain prompts skip PML: text reaches the tokenizer as is; chats use the model's chat
template or PML's plain turn format."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from promptcache.cache_store import owned_salt
from promptcache.model_runtime.attention.selection import AttentionReport, describe
from promptcache.model_runtime.engine import Engine, EngineConfig, Fidelity, TokenEvent
from promptcache.model_runtime.engine.encoding import encode_now
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.errors import ChatRenderError, InvalidRequestError
from promptcache.model_runtime.loading.loader import LoadedModel
from promptcache.model_runtime.module_encoder import EncodeReport, KVStore, ModuleEncoder
from promptcache.model_runtime.packed_attention import install
from promptcache.model_runtime.recent_encodings import RecentEncodings
from promptcache.model_runtime.results import CacheReport
from promptcache.model_runtime.sampling import SamplingParams
from promptcache.pml import PmlLimits, PromptPlan, Schema, TextEncoder, parse_prompt, parse_schema, token_plan
from promptcache.pml.chat_format import PLAIN_CHAT_FORMAT


class ModelRuntime:
    """The schemas of one model (their module KV encoded into `store`) and prompts planned against them. Schema
    bookkeeping is thread-safe; model compute runs on one thread at a time (the engine's)."""

    def __init__(self, loaded: LoadedModel, store: KVStore, limits: PmlLimits | None = None) -> None:
        self.loaded = loaded
        self.store = store
        self.limits = limits or PmlLimits()
        self.text_encoder = TextEncoder.from_tokenizer(loaded.tokenizer, max_piece_chars=self.limits.max_piece_chars)
        # Counted once: `len` of a transformers tokenizer rebuilds its vocabulary (262K entries: ~1.4 ms a call)
        self.vocab_size = len(loaded.tokenizer)
        install(loaded.model)  # every forward pass uses shared-module attention
        self.module_encoder = ModuleEncoder(loaded, store)
        self._schemas: dict[str, dict[str, Schema]] = {}  # namespace -> name -> schema
        self._lock = threading.Lock()
        self._runner: ModelRunner | None = None  # made on the first schema encoded here

    def parse_schema(self, text: str) -> Schema:
        """Parse and validate without registering or encoding (raises PmlError)."""
        return parse_schema(text, self.text_encoder, self.limits)

    def add_schema(self, schema: Schema, *, encode: bool = True, cache_salt: str | None = None,
                   progress: Callable[[int, int], None] | None = None, namespace: str = "") -> EncodeReport | None:
        """Encode `schema`'s modules (unless told not to), then register it in `namespace` (an owner's, replacing
        one of its name); a failed encoding registers nothing. A prompt sees the schemas of its namespace only."""
        report = None
        if encode:  # before serving: on this thread, through the engine's encode queue and runner
            if self._runner is None:
                self._runner = ModelRunner(self.loaded)
            report = encode_now(self.module_encoder, self._runner, schema, self.module_encoder.schema_jobs(schema),
                                cache_salt, progress)
        with self._lock:
            self._schemas.setdefault(namespace, {})[schema.name] = schema
        return report

    def remove_schema(self, name: str, namespace: str = "") -> Schema | None:
        with self._lock:
            return self._schemas.get(namespace, {}).pop(name, None)

    def get_schema(self, name: str, namespace: str = "") -> Schema | None:
        with self._lock:
            return self._schemas.get(namespace, {}).get(name)

    def schema_names(self, namespace: str = "") -> list[str]:
        with self._lock:
            return sorted(self._schemas.get(namespace, {}))

    def plan(self, prompt: str, *, isolated: bool = False, namespace: str = "",
             add_generation_prompt: bool = False) -> PromptPlan:
        """Resolve a `<prompt schema=...>` against the schemas registered in `namespace` (raises PmlError).
        `add_generation_prompt`: open the assistant turn after the prompt's last turn (pml.parse_prompt)."""
        with self._lock:
            schemas = dict(self._schemas.get(namespace, {}))
        return parse_prompt(prompt, schemas, self.text_encoder, self.limits, isolated=isolated,
                            add_generation_prompt=add_generation_prompt)

    def check_token_ids(self, token_ids: Sequence[int]) -> None:
        """Raises InvalidRequestError for an id outside the vocabulary."""
        vocab = self.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Token ids decoded together (special tokens included); InvalidRequestError for ids outside the vocabulary."""
        self.check_token_ids(token_ids)
        return cast(str, self.loaded.tokenizer.decode(list(token_ids)))  # one sequence: one string


@dataclass(frozen=True, slots=True)
class RuntimeStats:
    """Live numbers for metrics."""

    num_running: int
    num_waiting: int
    kv_used_bytes: int  # KV held by the running batch
    prefix_store_s: float  # time spent storing automatic prefix blocks
    num_encoded_segments: int  # module segments encoded because no tier held them


def key_salt(owner: str | None, salt: str | None) -> str | None:
    """The salt of every KV key `owner` uses: the client's `salt` inside the owner's (no owner: `salt` as is)."""
    return salt if owner is None else owned_salt(owner, salt)


RECENT_PROMPT_CHARS = 1 << 21  # characters of recent prompts whose token ids are kept (~2 MB of text, ~20 MB of ids)


class PromptRuntime:
    """Schemas, plans and generation of one model over one KV store, per `owner` (a tenant; None: the default): its own
    schema namespace and KV key salt, whatever `salt` its client sends. `submit` needs a running loop."""

    def __init__(self, loaded: LoadedModel, store: KVStore, config: EngineConfig,
                 limits: PmlLimits | None = None) -> None:
        self.model = ModelRuntime(loaded, store, limits)
        self.engine = Engine(self.model.module_encoder, config)
        # After the engine: its runner loads the bf16 kernel where it applies.
        self.attention: AttentionReport = describe(config.attention_backend, loaded.model.device, loaded.model.dtype)
        self._store = store
        # Plain-text and chat prompts' empty schema, in a namespace no owner's is ('' or a name not starting with '_').
        self._plain = self.model.parse_schema('<schema name="plain"/>')
        self.model.add_schema(self._plain, encode=False, namespace="_plain")
        tokenizer = loaded.tokenizer
        self._texts = RecentEncodings[str](lambda text: completion_tokens(tokenizer, text), len, RECENT_PROMPT_CHARS)
        self._chats = RecentEncodings[tuple[tuple[tuple[str, str], ...], ...]](
            lambda chat: chat_tokens(tokenizer, [dict(message) for message in chat]),
            lambda chat: sum(len(value) for message in chat for _, value in message), RECENT_PROMPT_CHARS)

    @property
    def max_positions(self) -> int:
        """Positions the model supports: prompt plus generated tokens."""
        return self.model.loaded.max_positions

    @property
    def text_encoder(self) -> TextEncoder:
        return self.model.text_encoder

    def start(self) -> None:
        self.engine.start()

    def stop(self) -> None:
        self.engine.stop()

    def parse_schema(self, text: str) -> Schema:
        """Parse and validate without registering or encoding (raises PmlError)."""
        return self.model.parse_schema(text)

    def encode_schema(self, schema: Schema, owner: str | None, *, keep_local: bool = True,
                      second_encodings: bool = False) -> concurrent.futures.Future[EncodeReport]:
        """Encode the owner's KV of `schema` that no tier holds, between decode steps (Engine.encode_schema)."""
        return self.engine.encode_schema(schema, key_salt(owner, None), owner=owner, keep_local=keep_local,
                                         second_encodings=second_encodings)

    def add_schema(self, schema: Schema, owner: str | None) -> None:
        """Register `schema` in the owner's namespace (replacing one of its name), without encoding."""
        self.model.add_schema(schema, encode=False, namespace=owner or "")

    def forget_schema(self, name: str, owner: str | None, *, delete_kv: bool = True) -> Schema | None:
        """Unregister the owner's schema `name` (None if none), deleting its upload's KV if `delete_kv` (copies
        salted by clients age out by LRU)."""
        schema = self.model.remove_schema(name, owner or "")
        if schema is None or not delete_kv:
            return schema
        encoder, salt = self.model.module_encoder, key_salt(owner, None)
        contexts = [(s.segment_id, s.context_ids) for s in schema.segments]
        contexts += [(sid, ctx) for sc in schema.scaffolds for sid, ctx in sc.contexts.items()]
        for segment_id, context_ids in contexts:
            self._store.delete(encoder.key(schema, segment_id, context_ids, salt))
        return schema

    def get_schema(self, name: str, owner: str | None = None) -> Schema | None:
        return self.model.get_schema(name, owner or "")

    def schema_names(self, owner: str | None = None) -> list[str]:
        return self.model.schema_names(owner or "")

    def plan(self, prompt: str, owner: str | None = None, *, isolated: bool = False) -> PromptPlan:
        """A PML prompt resolved against the owner's schemas, the generation prompt opened after its last
        turn unless it ends in an open `<assistant>` turn. Raises PmlError (UnknownSchemaError)."""
        return self.model.plan(prompt, isolated=isolated, namespace=owner or "", add_generation_prompt=True)

    def plan_text(self, text: str) -> PromptPlan:
        """A plain completion prompt: its tokens verbatim (no PML), reused through prefix blocks."""
        return token_plan(self._plain, self.tokenize(text))

    def plan_tokens(self, token_ids: Sequence[int]) -> PromptPlan:
        """A prompt given as token ids. Raises InvalidRequestError for an id outside the vocabulary."""
        self.model.check_token_ids(token_ids)
        return token_plan(self._plain, tuple(token_ids))

    def plan_chat(self, messages: Sequence[Mapping[str, str]]) -> PromptPlan:
        """A plain chat rendered by the model's chat template (raises ChatRenderError)."""
        return token_plan(self._plain, self.tokenize(messages=messages))

    def tokenize(self, text: str | None = None, messages: Sequence[Mapping[str, str]] | None = None) -> tuple[int, ...]:
        """Token ids exactly as `plan_text(text)` or `plan_chat(messages)` feeds them."""
        if messages is not None:
            return self._chats(tuple(tuple(message.items()) for message in messages))
        assert text is not None, "tokenize takes a text or messages"
        return self._texts(text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.model.detokenize(token_ids)

    def submit(self, plans: Sequence[PromptPlan], params: SamplingParams, *, owner: str | None, salt: str | None,
               request_ids: Sequence[str], fidelity: Fidelity,
               report_spans: bool = False) -> list[AsyncIterator[TokenEvent]]:
        """Queue every plan in the owner's queue, all or none; iterate each result for its events. Raises
        InvalidRequestError (a logit_bias token outside the vocabulary) and QueueFullError."""
        try:
            self.model.check_token_ids([token for token, _ in params.logit_bias])
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"logit_bias: {exc}") from None
        return self.engine.submit_many(list(plans), params, cache_salt=key_salt(owner, salt), tenant=owner,
                                       request_ids=list(request_ids), fidelity=fidelity, report_spans=report_spans)

    def explain(self, plan: PromptPlan, *, owner: str | None, salt: str | None, fidelity: Fidelity) -> CacheReport:
        """`Engine.explain` for the owner (tier lookups may reach shared storage: call it off the event loop)."""
        return self.engine.explain(plan, cache_salt=key_salt(owner, salt), fidelity=fidelity)

    def stats(self) -> RuntimeStats:
        engine = self.engine
        return RuntimeStats(engine.num_running, engine.num_waiting, engine.scheduler.memory.used_bytes,
                            engine.prefix_store_s, self.model.module_encoder.num_encoded_segments)


def completion_tokens(tokenizer: Any, text: str) -> tuple[int, ...]:
    """`text` encoded as a whole sequence (BOS if the tokenizer adds one); InvalidRequestError for bad Unicode."""
    _check_unicode(text, "the prompt")
    return tuple(tokenizer.encode(text, add_special_tokens=True))


def chat_tokens(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> tuple[int, ...]:
    """The chat rendered with its generation prompt, no specials added. Raises ChatRenderError, InvalidRequestError."""
    for i, message in enumerate(messages):
        _check_unicode(message["content"], f"message {i}'s content")
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as exc:  # templates raise arbitrary errors (jinja's raise_exception, type errors)
            raise ChatRenderError(f"the model's chat template refused these messages: {exc}") from None
    else:
        fmt = PLAIN_CHAT_FORMAT
        text = "".join(fmt.prefixes[m["role"]] + m["content"] + fmt.suffixes[m["role"]] for m in messages)
        text += fmt.generation_prompt
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def _check_unicode(text: str, what: str) -> None:
    """A lone surrogate (JSON's "\\ud800" decodes to one) is no character a tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{what} is not valid Unicode text: lone surrogate "
                                  f"U+{ord(text[exc.start]):04X} at character {exc.start}") from None

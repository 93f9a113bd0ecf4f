"""ModelRuntime: one loaded model, its schemas and its module encoder."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import cast

from promptcache.model_runtime.engine.encoding import encode_now
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.errors import InvalidRequestError
from promptcache.model_runtime.loading.loader import LoadedModel
from promptcache.model_runtime.module_encoder import EncodeReport, KVStore, ModuleEncoder
from promptcache.model_runtime.packed_attention import install
from promptcache.pml import PmlLimits, PromptPlan, Schema, TextEncoder, parse_prompt, parse_schema


class ModelRuntime:
    """The schemas of one model (their module KV encoded into `store`) and prompts planned against them. Schema
    bookkeeping is thread-safe; model compute runs on one thread at a time (the engine's)."""

    def __init__(self, loaded: LoadedModel, store: KVStore, limits: PmlLimits | None = None) -> None:
        self.loaded = loaded
        self.store = store
        self.limits = limits or PmlLimits()
        self.text_encoder = TextEncoder.from_tokenizer(loaded.tokenizer)
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
        vocab = len(self.loaded.tokenizer)
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids decoded together (special tokens included). Raises InvalidRequestError for
        an id outside the vocabulary."""
        self.check_token_ids(token_ids)
        return cast(str, self.loaded.tokenizer.decode(list(token_ids)))  # one sequence: one string

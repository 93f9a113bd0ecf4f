"""PromptService: the server's one gateway to schemas, plans, the engine, the store and metrics.

Model compute (module encoding) runs on the engine thread via `Engine.call`; nothing here blocks the
event loop on a tensor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from importlib import resources

from promptcache.cache_store import (
    BlockIndexConfig,
    RegistryState,
    SchemaRegistry,
    StoreConfig,
    StoredSchema,
    build_store,
)
from promptcache.model_runtime import LoadedModel, ModelRuntime, SamplingParams
from promptcache.model_runtime.engine import Engine, EngineConfig, Fidelity, ReusePlan, TokenEvent
from promptcache.pml import PmlLimits, PromptPlan, Schema, UnknownSchemaError, token_plan
from promptcache.server.errors import SchemaExistsError, SchemaNotFoundError, SchemaTooLongError
from promptcache.server.heap import trim_heap_every
from promptcache.server.metrics import Metrics, engine_families, store_families
from promptcache.server.settings import ServerSettings

logger = logging.getLogger(__name__)
PLAIN_SCHEMA = "__plain__"  # the empty schema that plain-text and chat prompts are resolved against


class PromptService:
    """Owns the runtime, engine, store, schema registry and metrics of one server process."""

    def __init__(self, settings: ServerSettings, loaded: LoadedModel) -> None:
        self.settings = settings
        self.model_name = loaded.name
        self.store = build_store(StoreConfig(
            device_max_bytes=settings.device_max_bytes, host_max_bytes=settings.host_max_bytes,
            redis_url=settings.redis_url, redis_max_bytes=settings.redis_max_bytes,
            redis_namespace=settings.namespace, redis_timeout_s=settings.redis_timeout_s,
            disk_dir=settings.disk_dir, disk_max_bytes=settings.disk_max_bytes), device=settings.device)
        self.registry = SchemaRegistry(settings.redis_url, namespace=settings.namespace,
                                       timeout_s=settings.redis_timeout_s)
        limits = PmlLimits(max_schema_bytes=settings.max_schema_bytes, max_prompt_bytes=settings.max_request_bytes)
        self.runtime = ModelRuntime(loaded, self.store, limits)
        prefix = BlockIndexConfig(block_size=settings.prefix_block_size, ttl_s=settings.prefix_ttl_s) \
            if settings.prefix_caching else None
        self.engine = Engine(self.runtime.module_encoder, EngineConfig(
            max_num_seqs=settings.max_num_seqs, max_kv_bytes=settings.max_kv_bytes,
            attention_backend=settings.attention_backend, prefix=prefix, fidelity=self.fidelity(None),
            max_prefill_tokens=settings.max_prefill_tokens, max_prefill_tokens_alone=settings.max_prefill_tokens_alone,
            min_prefill_tokens=settings.min_prefill_tokens, max_step_slowdown=settings.max_step_slowdown or None))
        self.metrics = Metrics(self.model_name)
        self.metrics.add_source(lambda: engine_families(self.engine, self.runtime.module_encoder, self.model_name))
        self.metrics.add_source(lambda: store_families(self.store))
        self.runtime.add_schema(self.runtime.parse_schema(f'<schema name="{PLAIN_SCHEMA}"/>'), encode=False)
        self.encode_ms: dict[str, float] = {}
        self._versions: dict[str, str] = {}  # schema name -> registry version this process serves
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Start the engine, adopt schemas persisted in the registry, preload the bundled examples."""
        self.engine.start()
        for stored in self.registry.list():
            self._adopt(stored)
        self._tasks.append(asyncio.create_task(self._follow_registry()))
        if self.settings.heap_trim_s > 0:
            self._tasks.append(asyncio.create_task(trim_heap_every(self.settings.heap_trim_s)))
        if self.settings.preload_examples:
            for example in sorted(resources.files("promptcache.examples").iterdir(), key=lambda p: p.name):
                if example.name.endswith(".pml"):
                    schema = self.runtime.parse_schema(example.read_text())
                    if self.runtime.get_schema(schema.name) is None:
                        await self.create_schema(example.read_text())

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.engine.stop()
        self.store.close()

    # -- schemas -----------------------------------------------------------------------------------
    async def create_schema(self, pml: str) -> Schema:
        """Validate, encode, then register: a failed upload leaves nothing behind (its encoded KV is
        only cache). Raises PmlError, SchemaTooLongError, SchemaExistsError."""
        schema = await asyncio.to_thread(self.runtime.parse_schema, pml)
        if schema.num_positions > self.runtime.loaded.max_positions:
            raise SchemaTooLongError(f"schema {schema.name!r} spans {schema.num_positions} positions; the model "
                                     f"supports {self.runtime.loaded.max_positions}")
        if schema.name == PLAIN_SCHEMA or await asyncio.to_thread(self.ensure_schema, schema.name) is not None:
            raise SchemaExistsError(f"schema {schema.name!r} already exists; DELETE it first to replace it")
        report = await asyncio.wrap_future(self.engine.encode_schema(schema))  # in chunks between decode steps
        # Shared-tier writes are write-behind: let them land so another replica finds the KV at once.
        await asyncio.to_thread(self.store.flush, self.settings.redis_timeout_s * 60)
        stored = self.registry.save(schema.name, pml, {"num_tokens": schema.num_positions})
        self.runtime.add_schema(schema, encode=False)
        self._versions[schema.name] = stored.version
        self.encode_ms[schema.name] = report.encode_ms
        return schema

    def list_schemas(self) -> list[Schema]:
        for stored in self.registry.list():
            if self.runtime.get_schema(stored.name) is None:
                self._adopt(stored)
        return [s for n in self.runtime.schema_names() if n != PLAIN_SCHEMA
                for s in [self.runtime.get_schema(n)] if s is not None]

    def get_schema(self, name: str) -> Schema:
        schema = self.ensure_schema(name) if name != PLAIN_SCHEMA else None
        if schema is None:
            raise SchemaNotFoundError(f"no schema named {name!r}")
        return schema

    async def delete_schema(self, name: str) -> None:
        await asyncio.to_thread(self._delete_schema, name)

    def _delete_schema(self, name: str) -> None:
        schema = self.get_schema(name)
        self.runtime.remove_schema(name)
        self.registry.delete(name)
        self.encode_ms.pop(name, None)
        self._versions.pop(name, None)
        encoder = self.runtime.module_encoder
        contexts = [(s.segment_id, s.context_ids) for s in schema.segments]
        contexts += [(sid, ctx) for sc in schema.scaffolds for sid, ctx in sc.contexts.items()]
        for segment_id, context_ids in contexts:  # unsalted KV; salted copies age out by LRU
            self.store.delete(encoder.key(schema, segment_id, context_ids, None))

    def ensure_schema(self, name: str) -> Schema | None:
        """The schema, from this process or from the shared registry (uploaded by another replica)."""
        schema = self.runtime.get_schema(name)
        if schema is not None:
            return schema
        stored = self.registry.load(name)
        return self._adopt(stored) if stored is not None else None

    def _adopt(self, stored: StoredSchema) -> Schema | None:
        """Register a persisted schema without encoding: its KV is fetched from the shared tier (or
        encoded on first use if no tier has it)."""
        try:
            schema = self.runtime.parse_schema(stored.pml_text)
        except Exception as exc:  # a registry entry this model cannot parse must not break startup
            logger.warning("skipping stored schema %r: %s", stored.name, exc)
            return None
        self.runtime.add_schema(schema, encode=False)
        self._versions[stored.name] = stored.version
        return schema

    async def _follow_registry(self) -> None:
        """Every `registry_poll_s`, drop schemas another replica deleted, adopt ones it replaced, and
        write back ones the shared registry lost."""
        while True:
            await asyncio.sleep(self.settings.registry_poll_s)
            try:
                state = await asyncio.to_thread(self.registry.state)
                if state is not None:
                    await asyncio.to_thread(self._apply_state, state)
            except Exception:  # keep following: a bad registry entry must not stop this loop
                logger.exception("following the schema registry failed")

    def _apply_state(self, state: RegistryState) -> None:
        for name, version in list(self._versions.items()):
            if state.versions.get(name) == version:
                continue
            # `state` may predate a re-upload this process adopted meanwhile: read the entry itself.
            stored = self.registry.load(name)
            if stored is not None:
                if stored.version != self._versions.get(name):
                    self._adopt(stored)
            elif name in state.deleted:
                self.runtime.remove_schema(name)
                self._versions.pop(name, None)
                self.encode_ms.pop(name, None)
            else:  # gone without a delete: Redis lost it (restart without persistence, flush)
                schema = self.runtime.get_schema(name)
                if schema is not None and self.registry.restore(StoredSchema(
                        name, schema.pml, {"num_tokens": schema.num_positions}, version=version)):
                    logger.warning("schema %r was missing from the shared registry; restored it", name)

    # -- prompts -----------------------------------------------------------------------------------
    def plan(self, prompt: str, *, isolated: bool = False) -> PromptPlan:
        try:
            return self.runtime.plan(prompt, isolated=isolated)
        except UnknownSchemaError as exc:
            if exc.schema_name and exc.schema_name != PLAIN_SCHEMA and self.ensure_schema(exc.schema_name):
                return self.runtime.plan(prompt, isolated=isolated)
            raise

    def plan_text(self, text: str) -> PromptPlan:
        """A plain completion prompt: its tokens verbatim (no PML), reused through prefix blocks."""
        return token_plan(self.runtime.get_schema(PLAIN_SCHEMA), self.runtime.tokenize_completion(text))

    def plan_tokens(self, token_ids: list[int]) -> PromptPlan:
        """A prompt given as token ids, fed as they are. Raises ValueError for an id outside the vocabulary."""
        self.runtime.check_token_ids(token_ids)
        return token_plan(self.runtime.get_schema(PLAIN_SCHEMA), tuple(token_ids))

    def plan_chat(self, messages: list[dict[str, str]]) -> PromptPlan:
        """A plain chat rendered by the model's chat template (no PML), reused through prefix blocks."""
        return token_plan(self.runtime.get_schema(PLAIN_SCHEMA), self.runtime.tokenize_chat(messages))

    def fidelity(self, mode: str | None, head_tokens: int | None = None) -> Fidelity:
        """The request's fidelity: its mode and k, or the server's defaults."""
        return Fidelity(mode or self.settings.fidelity,
                        self.settings.fidelity_head_tokens if head_tokens is None else head_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text as the tokenizer decodes it alone (logprobs report tokens this way)."""
        return self.runtime.token_text(token_id)

    @property
    def max_model_len(self) -> int:
        """Positions the model supports: prompt plus generated tokens."""
        return self.runtime.loaded.max_positions

    def tokenize(self, text: str | None = None, messages: list[dict[str, str]] | None = None) -> tuple[int, ...]:
        """Token ids exactly as /v1/completions (`text`) or /v1/chat/completions (`messages`) would feed them."""
        return self.runtime.tokenize_chat(messages) if messages is not None else self.runtime.tokenize_completion(text)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.runtime.detokenize(token_ids)

    def submit(self, plan: PromptPlan, params: SamplingParams, cache_salt: str | None, request_id: str,
               fidelity: Fidelity) -> AsyncIterator[TokenEvent]:
        return self.engine.submit(plan, params, cache_salt=cache_salt, request_id=request_id, fidelity=fidelity)

    def locate(self, plan: PromptPlan, cache_salt: str | None) -> list[str | None]:
        """For each cached segment of the plan, the tier holding its KV (None: would be computed)."""
        encoder = self.runtime.module_encoder
        return [self.store.contains(encoder.key(plan.schema, c.segment.segment_id, c.context_ids, cache_salt))
                for c in plan.cached]

    def explain(self, plan: PromptPlan, cache_salt: str | None,
                fidelity: Fidelity) -> tuple[ReusePlan, list[tuple[str, int]]]:
        """What serving the plan would reuse and recompute now, and the prefix blocks it would hit."""
        return self.engine.explain(plan, cache_salt=cache_salt, fidelity=fidelity)

"""PromptService: the server's one gateway to schemas, plans, the engine, the store and metrics. Model compute runs on
the engine thread; nothing here blocks the event loop on a tensor. Every call that touches schemas or KV names the
caller's tenant (the runtime's `owner`; None: default); its schemas are `<tenant>/<name>` in the registry."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Annotated

from fastapi import Depends, Request

from promptcache import cache_store
from promptcache.model_runtime import Fidelity, LoadedModel, PromptRuntime, SamplingParams, TokenEvent
from promptcache.pml import PmlError, PromptPlan, Schema, UnknownSchemaError, is_valid_name
from promptcache.server.errors import NotReadyError, SchemaNotFoundError, SchemaTooLongError
from promptcache.server.fidelity import ReportCache, ReportOptions, build_report
from promptcache.server.heap import trim_heap_every
from promptcache.server.metrics import Metrics, engine_families, store_families
from promptcache.server.quota import QuotaLedger
from promptcache.server.settings import ServerSettings
from promptcache.server.tenants import RequestRateLimiter, TenantDirectory, registry_name, split_registry_name
from promptcache.server.token_strings import TokenStrings
from promptcache.server.wire import FidelityKnobs, FidelityReport

logger = logging.getLogger(__name__)


class PromptService:
    """Owns the runtime, engine, store, schema registry and metrics of one server process."""

    def __init__(self, settings: ServerSettings, loaded: LoadedModel, tenants: TenantDirectory | None = None) -> None:
        self.settings = settings
        self.tenants = tenants or TenantDirectory({})
        store_config = settings.store_config(self.tenants.cache_shares())  # as `promptcache encode` maps it
        signer = cache_store.BlobSigner(store_config.blob_key)
        self.model_name = loaded.name
        self.weights = loaded.weights  # as loaded: `auto` resolved (int4 for a 4-bit GGUF)
        self.store = cache_store.build_store(store_config, device=settings.device)
        self.registry = cache_store.SchemaRegistry(settings.redis_url, namespace=settings.namespace,
                                                   timeout_s=settings.redis_timeout_s, signer=signer)
        self.quotas = QuotaLedger(settings.redis_url, namespace=settings.namespace, timeout_s=settings.redis_timeout_s)
        if settings.redis_url and not signer.enabled:
            logger.warning("Redis is shared storage and no blob key is set (PROMPTCACHE_BLOB_KEY): anyone who can "
                           "write to it can plant KV or schemas this server will serve (docs/security.md)")
        self.runtime = PromptRuntime(loaded, self.store, settings.engine_config(), settings.pml_limits())
        self.token_strings = TokenStrings.of(loaded.tokenizer)  # built on first use, off the event loop
        self.attention = self.runtime.attention
        self.metrics = Metrics(self.model_name, lambda: engine_families(self.runtime.stats(), self.model_name),
                               lambda: store_families(self.store))
        self.encode_ms: dict[str, float] = {}  # registry name -> encoding time of its upload here
        self._versions: dict[str, str] = {}  # registry name -> registry version this process serves
        self._tasks: list[asyncio.Task] = []
        self.fidelity_reports = ReportCache()  # by schema version: a re-upload is a new version

    async def start(self) -> None:
        """Start the engine, adopt schemas persisted in the registry, preload the bundled examples."""
        self.runtime.start()
        known: dict[str | None, dict[str, tuple[int, str]]] = {}
        for stored in self.registry.list():
            if (schema := self._adopt(stored)) is not None:
                tenant, name = split_registry_name(stored.name)
                known.setdefault(tenant, {})[name] = (schema.num_positions, stored.version)
        for tenant, schemas in known.items():  # schemas stored before the quota ledger counted them
            self.quotas.record(tenant, schemas)
        self._tasks.append(asyncio.create_task(self._follow_registry()))
        if self.settings.heap_trim_s > 0:
            self._tasks.append(asyncio.create_task(trim_heap_every(self.settings.heap_trim_s)))
        if self.settings.preload_examples:
            await self._preload_examples()

    async def _preload_examples(self) -> None:
        """The bundled example schemas, but those this model cannot take (a chat template role tags cannot split per
        role, as Gemma's that moves the system text into the first user turn; a context shorter than the schema):
        those are skipped with a warning, the server serves without them."""
        for example in sorted(resources.files("promptcache.examples").iterdir(), key=lambda p: p.name):
            if not example.name.endswith(".pml"):
                continue
            try:
                if self.runtime.get_schema(self.runtime.parse_schema(example.read_text()).name) is None:
                    await self.create_schema(example.read_text())
            except (PmlError, SchemaTooLongError) as exc:
                logger.warning("the example schema %s is not preloaded: %s", example.name, exc)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.runtime.stop()
        self.store.close()

    # -- schemas -----------------------------------------------------------------------------------
    async def create_schema(self, pml: str, tenant: str | None = None) -> Schema:
        """Validate, reserve in the tenant's quota, encode, then register: a failed upload leaves nothing behind. Raises
        PmlError, SchemaTooLongError, SchemaExistsError, QuotaExceededError."""
        schema = await asyncio.to_thread(self.runtime.parse_schema, pml)
        if schema.num_positions > self.runtime.max_positions:
            raise SchemaTooLongError(f"schema {schema.name!r} spans {schema.num_positions} positions; the model "
                                     f"supports {self.runtime.max_positions}")
        if await asyncio.to_thread(self.ensure_schema, schema.name, tenant) is not None:
            raise cache_store.SchemaExistsError(f"schema {schema.name!r} already exists; DELETE it first to replace it")
        qualified = registry_name(tenant, schema.name)
        async with self.quotas.hold(tenant, schema.name, schema.num_positions, self.tenants.quota(tenant),
                                    lambda: self._stored_versions(tenant)) as hold:
            # In chunks between decode steps; salted with the tenant like every later lookup of it.
            report = await asyncio.wrap_future(self.runtime.encode_schema(
                schema, tenant, keep_local=self.settings.upload_kv_local,
                second_encodings=self.settings.second_encodings_at_upload))
            # Shared-tier writes are write-behind: let them land so another replica finds the KV at once.
            await asyncio.to_thread(self.store.flush, self.settings.redis_timeout_s * 60)
            stored = await asyncio.to_thread(self.registry.save, qualified, pml, {"num_tokens": schema.num_positions})
            hold.commit(stored.version)
        self.runtime.add_schema(schema, tenant)
        self._versions[qualified] = stored.version
        self.encode_ms[qualified] = report.encode_ms
        return schema

    def list_schemas(self, tenant: str | None = None) -> list[Schema]:
        """The tenant's schemas (adopting ones another replica uploaded: only the tenant's documents are read)."""
        for name in self._registered(tenant) or ():
            if self.runtime.get_schema(name, tenant) is not None:
                continue
            if (stored := self.registry.load(registry_name(tenant, name))) is not None:
                self._adopt(stored)
        return [s for n in self.runtime.schema_names(tenant) for s in [self.runtime.get_schema(n, tenant)]
                if s is not None]

    def _registered(self, tenant: str | None) -> dict[str, str] | None:
        """Name -> version of the tenant's schemas in the registry's index (no document read); None without one."""
        if (state := self.registry.state()) is None:
            return None
        return {name: version for qualified, version in state.versions.items()
                for owner, name in [split_registry_name(qualified)] if owner == tenant}

    def _stored_versions(self, tenant: str | None) -> dict[str, str] | None:
        """Name -> version of the tenant's schemas whose stored document passes the registry's check (None without a
        shared registry): what quota shares are judged by, so a schema lost or failing its check frees its share."""
        if (names := self._registered(tenant)) is None:
            return None
        return {name: stored.version for name in names
                if (stored := self.registry.load(registry_name(tenant, name))) is not None}

    def get_schema(self, name: str, tenant: str | None = None) -> Schema:
        if (schema := self.ensure_schema(name, tenant)) is None:  # another tenant's of this name is as absent
            raise SchemaNotFoundError(f"no schema named {name!r}")
        return schema

    async def fidelity_report(self, name: str, options: ReportOptions, tenant: str | None = None,
                              before_compute: Callable[[], None] = lambda: None) -> FidelityReport:
        """The tenant's schema's fidelity report, cached per schema version, or computed (`before_compute()` first: it
        may refuse). Raises SchemaNotFoundError, and what serving a sample raises."""
        schema = await asyncio.to_thread(self.get_schema, name, tenant)
        qualified = registry_name(tenant, name)
        return await self.fidelity_reports.get((qualified, self._versions.get(qualified), options),
                                               lambda: build_report(self, schema, tenant, options), before_compute)

    def delete_schema(self, name: str, tenant: str | None = None) -> None:
        self.get_schema(name, tenant)  # raises SchemaNotFoundError (adopts one another replica uploaded)
        qualified = registry_name(tenant, name)
        self.runtime.forget_schema(name, tenant)  # and the KV its upload encoded
        self.registry.delete(qualified)
        self.quotas.forget(tenant, name, self._versions.get(qualified, ""))  # that version's share, no re-upload's
        self.encode_ms.pop(qualified, None)
        self._versions.pop(qualified, None)

    def ensure_schema(self, name: str, tenant: str | None = None) -> Schema | None:
        """The tenant's schema, from this process or from the shared registry (uploaded by another replica).
        A string that is no schema name (`alpha/kb` spells a registry name of tenant alpha's) names none."""
        if not is_valid_name(name):
            return None
        if (schema := self.runtime.get_schema(name, tenant)) is not None:
            return schema
        stored = self.registry.load(registry_name(tenant, name))
        return self._adopt(stored) if stored is not None else None

    def _adopt(self, stored: cache_store.StoredSchema) -> Schema | None:
        """Register a persisted schema without encoding: its KV comes from a shared tier, or is encoded on first use."""
        try:
            schema = self.runtime.parse_schema(stored.pml_text)
        except Exception as exc:  # a registry entry this model cannot parse must not break startup
            logger.warning("skipping stored schema %r: %s", stored.name, exc)
            return None
        tenant, name = split_registry_name(stored.name)
        if schema.name != name:  # the document must be the one stored under this name
            logger.warning("skipping stored schema %r: its document names %r", stored.name, schema.name)
            return None
        self.runtime.add_schema(schema, tenant)
        self._versions[stored.name] = stored.version
        return schema

    async def _follow_registry(self) -> None:
        """Every `registry_poll_s`: drop schemas deleted elsewhere, adopt replaced ones, restore ones Redis lost."""
        while True:
            await asyncio.sleep(self.settings.registry_poll_s)
            try:
                if (state := await asyncio.to_thread(self.registry.state)) is not None:
                    await asyncio.to_thread(self._apply_state, state)
            except Exception:  # keep following: a bad registry entry must not stop this loop
                logger.exception("following the schema registry failed")

    def _apply_state(self, state: cache_store.RegistryState) -> None:
        for qualified, version in list(self._versions.items()):
            if state.versions.get(qualified) == version:
                continue
            tenant, name = split_registry_name(qualified)
            # `state` may predate a re-upload this process adopted meanwhile: read the entry itself.
            if (stored := self.registry.load(qualified)) is not None:
                if stored.version != self._versions.get(qualified):
                    self._adopt(stored)
            elif qualified in state.deleted:
                self.runtime.forget_schema(name, tenant, delete_kv=False)
                self._versions.pop(qualified, None)
                self.encode_ms.pop(qualified, None)
            else:  # gone without a delete: Redis lost it (restart without persistence, flush)
                schema = self.runtime.get_schema(name, tenant)
                if schema is not None and self.registry.restore(cache_store.StoredSchema(
                        qualified, schema.pml, {"num_tokens": schema.num_positions}, version=version)):
                    logger.warning("schema %r was missing from the shared registry; restored it", qualified)
                    self.quotas.record(tenant, {name: (schema.num_positions, version)})

    # -- prompts -----------------------------------------------------------------------------------
    def plan(self, prompt: str, *, tenant: str | None = None) -> PromptPlan:
        """A PML prompt against the tenant's schemas (one another replica uploaded is adopted first); unless it ends in
        an open `<assistant>` turn, the generation prompt follows its last turn."""
        try:
            return self.runtime.plan(prompt, tenant)
        except UnknownSchemaError as exc:
            if exc.schema_name and self.ensure_schema(exc.schema_name, tenant):
                return self.runtime.plan(prompt, tenant)
            raise

    def fidelity(self, mode: str | None, knobs: FidelityKnobs | None = None) -> Fidelity:
        """The request's fidelity from its (checked) wire fields, each knob the server's setting where unset."""
        given = {name: getattr(knobs, name) for name in FidelityKnobs.model_fields} if knobs else {}
        given["fidelity"] = mode
        return self.settings.model_copy(update={k: v for k, v in given.items() if v is not None}).default_fidelity()

    def submit(self, plan: PromptPlan, params: SamplingParams, cache_salt: str | None, request_id: str,
               fidelity: Fidelity, tenant: str | None = None, report_spans: bool = False) -> AsyncIterator[TokenEvent]:
        """Raises InvalidRequestError for a logit_bias token outside the vocabulary, QueueFullError when the tenant's
        waiting queue is full. `report_spans`: the final event lists the prompt as spans by where their KV came from."""
        return self.submit_many([plan], params, cache_salt, [request_id], fidelity, tenant, report_spans)[0]

    def submit_many(self, plans: list[PromptPlan], params: SamplingParams, cache_salt: str | None,
                    request_ids: list[str], fidelity: Fidelity, tenant: str | None = None,
                    report_spans: bool = False) -> list[AsyncIterator[TokenEvent]]:
        """`submit` every plan, all or none (the tenant's queue has room for them all, or none is queued)."""
        return self.runtime.submit(plans, params, owner=tenant, salt=cache_salt, request_ids=request_ids,
                                   fidelity=fidelity, report_spans=report_spans)


# -- the routes' dependencies --------------------------------------------------------------------------------------
def get_service(request: Request) -> PromptService:
    """The app's PromptService; NotReadyError (a 503) while the model loads, or when it failed to."""
    if (service := getattr(request.app.state, "service", None)) is None:
        error = getattr(request.app.state, "load_error", None)
        raise NotReadyError(f"the model failed to load: {error}" if error else "the model is still loading")
    return service


Service = Annotated[PromptService, Depends(get_service)]


def get_tenant(request: Request) -> str | None:
    """The caller's tenant, set by the RequestGuard from its API key (None: the default tenant)."""
    return request.state.tenant if "tenant" in request.scope.get("state", {}) else None


Tenant = Annotated[str | None, Depends(get_tenant)]


def get_rates(request: Request) -> RequestRateLimiter:
    """The rate limiter the RequestGuard counted one hit with: generating routes count their samples past it."""
    return request.app.state.rates


Rates = Annotated[RequestRateLimiter, Depends(get_rates)]

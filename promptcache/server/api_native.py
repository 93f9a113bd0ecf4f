"""Native REST API: schemas, PML generation (JSON or SSE), prompt explanation."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse

from promptcache.model_runtime.results import slowest_tier
from promptcache.pml import Schema
from promptcache.server.generation import (
    DONE,
    collect,
    raise_for_error,
    record,
    sampling_params,
    sse,
    sse_error,
    wire_cache,
    wire_timings,
    wire_usage,
)
from promptcache.server.service import PromptService
from promptcache.server.state import Service
from promptcache.server.wire import (
    Choice,
    ExplainRequest,
    Explanation,
    GenerateChunk,
    GenerateRequest,
    GenerateResponse,
    ModuleInfo,
    ModuleReport,
    SchemaCreate,
    SchemaInfo,
    SchemaList,
)

router = APIRouter(prefix="/v1")


def schema_info(service: PromptService, schema: Schema) -> SchemaInfo:
    return SchemaInfo(name=schema.name, num_tokens=schema.num_positions,
                      modules=[ModuleInfo(**row) for row in schema.module_table()],
                      encode_ms=service.encode_ms.get(schema.name), num_segments=len(schema.segments),
                      scaffolds=[list(sc.module_paths) for sc in schema.scaffolds])


@router.post("/schemas", status_code=201, response_model=SchemaInfo)
async def create_schema(body: SchemaCreate, service: Service) -> SchemaInfo:
    return schema_info(service, await service.create_schema(body.pml))


@router.get("/schemas", response_model=SchemaList)
async def list_schemas(service: Service) -> SchemaList:
    return SchemaList(data=[schema_info(service, s) for s in service.list_schemas()])


@router.get("/schemas/{name}", response_model=SchemaInfo)
async def get_schema(name: str, service: Service) -> SchemaInfo:
    return schema_info(service, service.get_schema(name))


@router.delete("/schemas/{name}", status_code=204)
async def delete_schema(name: str, service: Service) -> Response:
    await service.delete_schema(name)
    return Response(status_code=204)


@router.post("/generate", response_model=GenerateResponse)
async def generate(body: GenerateRequest, service: Service):
    plan = service.plan(body.prompt)
    params = sampling_params(body, service.settings.max_tokens_limit)
    request_id = f"gen-{uuid.uuid4().hex[:24]}"
    events = service.submit(plan, params, body.cache_salt, request_id)
    if body.stream:
        return StreamingResponse(_stream(service, events, request_id, plan.approximations),
                                 media_type="text/event-stream")
    outcome = await collect(events, params.n)
    record(service.metrics, outcome.final, outcome.finish_reasons)
    return GenerateResponse(
        id=request_id, model=service.model_name,
        choices=[Choice(index=i, text=t, finish_reason=r) for i, (t, r) in
                 enumerate(zip(outcome.texts, outcome.finish_reasons))],
        usage=wire_usage(outcome.final), cache=wire_cache(outcome.final, plan.approximations),
        timings=wire_timings(outcome.final))


async def _stream(service: PromptService, events, request_id: str, approximations):
    reasons: dict[int, str | None] = {}
    try:
        async for event in events:
            raise_for_error(event)
            if event.finish_reason is not None:
                reasons[event.index] = event.finish_reason
            chunk = GenerateChunk(id=request_id, model=service.model_name,
                                  choices=[Choice(index=event.index, text=event.text,
                                                  finish_reason=event.finish_reason)])
            if event.usage is not None:
                chunk.usage, chunk.cache = wire_usage(event), wire_cache(event, approximations)
                chunk.timings = wire_timings(event)
                record(service.metrics, event, list(reasons.values()))
            yield sse(chunk.model_dump(exclude_none=True))
    except Exception as exc:  # headers are sent: report in-band, then end the stream
        yield sse_error(exc)
    yield DONE


@router.post("/prompts/explain", response_model=Explanation, response_model_by_alias=True)
async def explain(body: ExplainRequest, service: Service) -> Explanation:
    plan = service.plan(body.prompt)
    tiers = service.locate(plan, body.cache_salt)
    by_module: dict[str, list[str | None]] = {}
    for cached, tier in zip(plan.cached, tiers):
        by_module.setdefault(cached.segment.owner, []).append(tier)
    modules = []
    for path in plan.module_paths:
        found = by_module.get(path, [])
        tier = None if not found or None in found else slowest_tier(found)
        tokens = sum(len(c.segment.token_ids) for c in plan.cached if c.segment.owner == path)
        modules.append(ModuleReport(path=path, num_tokens=tokens, tier=tier))
    missing = sum(len(c.segment.token_ids) for c, t in zip(plan.cached, tiers) if t is None)
    return Explanation(schema_name=plan.schema.name, exact=plan.is_exact, approximations=list(plan.approximations),
                       modules=modules, prompt_tokens=plan.num_prompt_tokens, cached_tokens=plan.num_cached_tokens,
                       tokens_to_compute=plan.num_new_tokens + missing)

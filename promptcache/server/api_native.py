"""Native REST API: schemas, PML generation (JSON or SSE), prompt explanation."""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from promptcache.pml import Schema
from promptcache.server import generation, wire
from promptcache.server.errors import public_error
from promptcache.server.fidelity import report_options
from promptcache.server.json_body import json_off_loop
from promptcache.server.request_body import OffLoopBodyRoute
from promptcache.server.service import PromptService, Rates, Service, Tenant
from promptcache.server.tenants import registry_name

router = APIRouter(prefix="/v1", route_class=OffLoopBodyRoute)


def schema_info(service: PromptService, schema: Schema, tenant: str | None) -> wire.SchemaInfo:
    return wire.SchemaInfo(
        name=schema.name, num_tokens=schema.num_positions, num_segments=len(schema.segments),
        modules=[wire.ModuleInfo(**row, role=_role(schema, row)) for row in schema.module_table()],
        encode_ms=service.encode_ms.get(registry_name(tenant, schema.name)),
        scaffolds=[list(sc.module_paths) for sc in schema.scaffolds], always_included=schema.always_included())


def _role(schema: Schema, module: dict) -> str | None:
    """The role of the top-level role section whose positions hold the module's, if any."""
    return next((section.role for section in schema.role_sections.values() if not section.owner_path
                 and section.start <= module["start"] and module["end"] <= section.end), None)


@router.post("/schemas", status_code=201, response_model=wire.SchemaInfo)
async def create_schema(body: wire.SchemaCreate, service: Service, tenant: Tenant, rates: Rates) -> wire.SchemaInfo:
    """Upload; with `fidelity_report`, the schema's fidelity report follows the encoding (counted against the
    tenant's rate before the upload; a report that fails leaves the upload done, its error in the response)."""
    options = None
    if body.fidelity_report is not False:
        query = body.fidelity_report if body.fidelity_report is not True else wire.FidelityReportQuery()
        options = report_options(query, service)
        rates.check(tenant, 1 + options.num_requests, already_counted=1)
    info = schema_info(service, await service.create_schema(body.pml, tenant), tenant)
    if options is not None:
        try:
            info.fidelity_report = await service.fidelity_report(info.name, options, tenant)
        except Exception as exc:  # the schema is uploaded: say why its report is missing, never fail the upload
            info.fidelity_report_error = public_error(exc, "a fidelity report")[2]
    return info


@router.get("/schemas/{name}/fidelity", response_model=wire.FidelityReport, response_model_by_alias=True)
async def schema_fidelity(name: str, query: Annotated[wire.FidelityReportQuery, Query()], service: Service,
                          tenant: Tenant, rates: Rates) -> wire.FidelityReport:
    """Each fidelity mode's first token against a full prefill on sampled module combinations of the schema, cached per
    schema version and options; a computed one counts its requests against the tenant's rate."""
    options = report_options(query, service)
    return await service.fidelity_report(name, options, tenant,
                                         lambda: rates.check(tenant, options.num_requests, already_counted=1))


@router.get("/schemas", response_model=wire.SchemaList)
async def list_schemas(service: Service, tenant: Tenant) -> wire.SchemaList:
    schemas = await asyncio.to_thread(service.list_schemas, tenant)  # the registry may be a Redis call away
    return wire.SchemaList(data=[schema_info(service, s, tenant) for s in schemas])


@router.get("/schemas/{name}", response_model=wire.SchemaInfo)
async def get_schema(name: str, service: Service, tenant: Tenant) -> wire.SchemaInfo:
    return schema_info(service, await asyncio.to_thread(service.get_schema, name, tenant), tenant)


@router.delete("/schemas/{name}", status_code=204)
async def delete_schema(name: str, service: Service, tenant: Tenant) -> Response:
    await asyncio.to_thread(service.delete_schema, name, tenant)
    return Response(status_code=204)


@router.post("/generate", response_model=wire.GenerateResponse)
async def generate(body: wire.GenerateRequest, service: Service, tenant: Tenant, rates: Rates, request: Request):
    rates.check(tenant, body.n, already_counted=1)
    plan = await asyncio.to_thread(lambda: service.plan(body.prompt, tenant=tenant))  # parsing stays off the loop
    params = generation.sampling_params(body, service.settings.max_tokens_limit, body.logprobs)
    request_id = f"gen-{uuid.uuid4().hex[:24]}"
    events = service.submit(plan, params, body.cache_salt, request_id,
                            service.fidelity(body.fidelity, body), tenant, report_spans=body.return_spans)
    if params.logprobs is not None:  # streamed tokens are looked up on the event loop: the table must be there
        await service.token_strings.ready()
    if body.stream:
        return StreamingResponse(generation.sse_stream(_chunks(service, events, request_id, tenant, body.return_spans)),
                                 media_type="text/event-stream")
    [outcome] = await generation.collect_all(request, [events], params.n)  # a client gone: aborted
    generation.record(service.metrics, outcome.report, outcome.finish_reasons, tenant)

    def answer() -> wire.GenerateResponse:  # decodes span texts and looks up every token's logprobs: off the loop
        detokenize = service.runtime.detokenize if body.return_spans else None
        usage, cache, timings = generation.wire_report(outcome.report, detokenize)
        choices = [wire.Choice(index=i, text=t, finish_reason=r,
                               logprobs=generation.wire_logprobs(e, service.token_strings.text))
                   for i, (t, r, e) in enumerate(zip(outcome.texts, outcome.finish_reasons, outcome.events))]
        return wire.GenerateResponse(id=request_id, model=service.model_name, choices=choices, usage=usage,
                                     cache=cache, timings=timings)

    return await json_off_loop(answer)


async def _chunks(service: PromptService, events, request_id: str, tenant: str | None, return_spans: bool):
    reasons: dict[int, str | None] = {}
    async for event in events:
        generation.raise_for_error(event)
        if event.finish_reason is not None:
            reasons[event.index] = event.finish_reason
        logprobs = generation.wire_logprobs([event], service.token_strings.text) if event.token_id is not None else None
        chunk = wire.GenerateChunk(id=request_id, model=service.model_name, choices=[wire.Choice(
            index=event.index, text=event.text, finish_reason=event.finish_reason, logprobs=logprobs)])
        if event.report is not None:
            # spans decode every prompt token: off the event loop; the rest is cheap enough to build on it
            chunk.usage, chunk.cache, chunk.timings = (await asyncio.to_thread(
                generation.wire_report, event.report, service.runtime.detokenize) if return_spans
                else generation.wire_report(event.report))
            generation.record(service.metrics, event.report, list(reasons.values()), tenant)
        payload = chunk.model_dump(exclude_none=True)
        if chunk.cache is not None:  # the report whole (null encoded_after, module, tier), as in the JSON response
            payload["cache"] = chunk.cache.model_dump()
        yield payload


@router.post("/prompts/explain", response_model=wire.Explanation, response_model_by_alias=True)
async def explain(body: wire.ExplainRequest, service: Service, tenant: Tenant) -> wire.Explanation:
    """Dry run: which module KV and prefix blocks the prompt would reuse now, and what it would compute.
    Runs in a worker thread (tier lookups may reach Redis); never waits on the engine."""
    return await asyncio.to_thread(_explain, body, service, tenant)


def _explain(body: wire.ExplainRequest, service: PromptService, tenant: str | None) -> wire.Explanation:
    plan = service.plan(body.prompt, tenant=tenant)
    report = service.runtime.explain(plan, owner=tenant, salt=body.cache_salt,
                                     fidelity=service.fidelity(body.fidelity, body))
    return wire.Explanation(**generation.to_wire(report).model_dump(), schema=report.schema_name,
                            prompt_tokens=report.num_prompt_tokens, cached_tokens=report.num_cached,
                            tokens_to_compute=report.num_to_compute)

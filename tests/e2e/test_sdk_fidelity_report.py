"""The SDK's fidelity report against a real server: typed, the same report as the HTTP route, sync and async."""

from __future__ import annotations

import httpx
import pytest

from promptcache.clients import AsyncClient, BadRequestError, Client, FidelityReport, NotFoundError
from tests.e2e.test_sdk import SCHEMA


def test_sync_report_is_the_routes_report(live_server):
    server = live_server()
    with Client(server.url, max_retries=0, timeout_s=300) as client:
        info = client.schemas.create(SCHEMA.to_pml(), fidelity_report=True)
        assert isinstance(info.fidelity_report, FidelityReport) and info.fidelity_report_error is None
        report = client.schemas.fidelity("kb", num_samples=3, question="", fidelity_head_tokens=2)
        assert report.schema_name == "kb" and not report.cached and report.question == ""
        assert report.fidelity_head_tokens == 2 and set(report.modes) == {"exact", "fast", "balanced"}
        raw = httpx.get(server.url + "/v1/schemas/kb/fidelity",
                        params={"num_samples": 3, "question": "", "fidelity_head_tokens": 2}, timeout=300).json()
        assert raw["cached"] and FidelityReport.model_validate(raw).samples == report.samples
        assert report.modes["exact"].top1_agreement == 1.0
        low, high = report.modes["fast"].agreement_ci95
        assert low <= report.modes["fast"].top1_agreement <= high
        # kb has two modules: {cats}, {tea} and both are all its combinations
        assert sorted(s.module_paths for s in report.samples) == [["cats"], ["cats", "tea"], ["tea"]]
        assert client.schemas.fidelity("kb", num_samples=16).cached  # the upload's report, default options
        with pytest.raises(BadRequestError, match="at most"):
            client.schemas.fidelity("kb", num_samples=10_000)
        with pytest.raises(NotFoundError):
            client.schemas.fidelity("ghost")


async def test_async_report(live_server):
    server = live_server()
    async with AsyncClient(server.url, max_retries=0, timeout_s=300) as client:
        info = await client.schemas.create(SCHEMA.to_pml())
        assert info.fidelity_report is None
        report = await client.schemas.fidelity("kb", num_samples=2, seed=3, max_imports=1)
        assert report.num_samples == 2 == len(report.samples) and report.seed == 3
        assert all(len(s.module_paths) == 1 for s in report.samples)
        assert (await client.schemas.fidelity("kb", num_samples=2, seed=3, max_imports=1)).cached

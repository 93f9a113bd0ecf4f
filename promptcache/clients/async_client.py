"""AsyncClient: the asynchronous SDK (httpx.AsyncClient); same surface as Client."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Literal, overload

import httpx

from promptcache.clients.base import DEFAULT_BASE_URL, AsyncStream, BaseClient, RequestSpec
from promptcache.clients.types import Explanation, FidelityReport, Generation, GenerationChunk, SchemaInfo


class AsyncSchemas:
    """`client.schemas` (async): upload, list, get and delete PML schemas; their fidelity reports."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, pml: str, *, fidelity_report: bool = False) -> SchemaInfo:
        """Upload a schema (see `Client.schemas.create`)."""
        body = BaseClient.body(pml=pml, fidelity_report=True if fidelity_report else None)
        return BaseClient.parse(await self._client._send(RequestSpec("POST", "/v1/schemas", body)), SchemaInfo)

    async def list(self) -> list[SchemaInfo]:
        data = (await self._client._send(RequestSpec("GET", "/v1/schemas"))).json()["data"]
        return [SchemaInfo.model_validate(item) for item in data]

    async def get(self, name: str) -> SchemaInfo:
        return BaseClient.parse(await self._client._send(RequestSpec("GET", f"/v1/schemas/{name}")), SchemaInfo)

    async def delete(self, name: str) -> None:
        await self._client._send(RequestSpec("DELETE", f"/v1/schemas/{name}"))

    async def fidelity(self, name: str, *, num_samples: int | None = None, seed: int | None = None,
                 question: str | None = None, max_imports: int | None = None,
                 fidelity_head_tokens: int | None = None,
                 fidelity_positions: Literal["contiguous", "layout"] | None = None,
                 fidelity_context: Literal["schema", "predecessor"] | None = None) -> FidelityReport:
        """The schema's fidelity report (see `Client.schemas.fidelity`)."""
        path = BaseClient.fidelity_path(name, num_samples=num_samples, seed=seed, question=question,
                                        max_imports=max_imports, fidelity_head_tokens=fidelity_head_tokens,
                                        fidelity_positions=fidelity_positions, fidelity_context=fidelity_context)
        return BaseClient.parse(await self._client._send(RequestSpec("GET", path)), FidelityReport)


class AsyncClient(BaseClient):
    """Asynchronous promptcache client. Retries 429/5xx/connection errors with backoff."""

    def __init__(self, base_url: str = DEFAULT_BASE_URL, *, api_key: str | None = None, timeout_s: float = 60.0,
                 max_retries: int = 2, http_client: httpx.AsyncClient | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        super().__init__(base_url, api_key, timeout_s, max_retries)
        self._http = http_client or httpx.AsyncClient(timeout=timeout_s)
        self._sleep = sleep
        self.schemas = AsyncSchemas(self)

    @overload
    async def generate(self, prompt: str, *, max_tokens: int | None = None, temperature: float | None = None,
                       top_p: float | None = None, top_k: int | None = None, n: int | None = None,
                       stop: str | list[str] | None = None, seed: int | None = None, cache_salt: str | None = None,
                       fidelity: Literal["fast", "balanced", "exact"] | None = None,
                       fidelity_head_tokens: int | None = None,
                       fidelity_positions: Literal["contiguous", "layout"] | None = None,
                       fidelity_context: Literal["schema", "predecessor"] | None = None,
                       return_spans: bool = False, stream: Literal[False] = False) -> Generation: ...

    @overload
    async def generate(self, prompt: str, *, max_tokens: int | None = None, temperature: float | None = None,
                       top_p: float | None = None, top_k: int | None = None, n: int | None = None,
                       stop: str | list[str] | None = None, seed: int | None = None, cache_salt: str | None = None,
                       fidelity: Literal["fast", "balanced", "exact"] | None = None,
                       fidelity_head_tokens: int | None = None,
                       fidelity_positions: Literal["contiguous", "layout"] | None = None,
                       fidelity_context: Literal["schema", "predecessor"] | None = None,
                       return_spans: bool = False, stream: Literal[True]) -> AsyncStream[GenerationChunk]: ...

    async def generate(self, prompt: str, *, max_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, n: int | None = None,
                 stop: str | list[str] | None = None, seed: int | None = None, cache_salt: str | None = None,
                 fidelity: Literal["fast", "balanced", "exact"] | None = None, fidelity_head_tokens: int | None = None,
                 fidelity_positions: Literal["contiguous", "layout"] | None = None,
                 fidelity_context: Literal["schema", "predecessor"] | None = None,
                 return_spans: bool = False, stream: bool = False) -> Generation | AsyncStream[GenerationChunk]:
        """Generate from a PML prompt; with `stream=True`, iterate chunks (the options: see `Client.generate`)."""
        body = self.generate_body(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                  n=n, stop=stop, seed=seed, cache_salt=cache_salt, stream=stream,
                                  fidelity=fidelity, fidelity_head_tokens=fidelity_head_tokens,
                                  fidelity_positions=fidelity_positions, fidelity_context=fidelity_context,
                                  return_spans=return_spans)
        response = await self._send(RequestSpec("POST", "/v1/generate", body, stream=stream))
        return AsyncStream(response, GenerationChunk) if stream else self.parse(response, Generation)

    async def explain(self, prompt: str, cache_salt: str | None = None) -> Explanation:
        """Dry run: which modules hit and on which tier, tokens to compute, exact or not."""
        body = self.body(prompt=prompt, cache_salt=cache_salt)
        return self.parse(await self._send(RequestSpec("POST", "/v1/prompts/explain", body)), Explanation)

    async def health(self) -> bool:
        try:
            return (await self._http.get(self.base_url + "/health", timeout=self.timeout_s)).status_code == 200
        except httpx.HTTPError:
            return False

    async def _send(self, spec: RequestSpec) -> httpx.Response:
        attempt = 0
        while True:
            request = self._http.build_request(spec.method, self.base_url + spec.path, json=spec.json,
                                               headers=self.headers())
            try:
                response = await self._http.send(request, stream=spec.stream)
            except httpx.TransportError as exc:  # timeouts included
                self.raise_unless_retried(attempt, spec, exc)
                await self._sleep(self.backoff_s(attempt))
            else:
                if response.status_code < 400:
                    return response
                if spec.stream:
                    await response.aread()
                if not self.should_retry(attempt, self.max_retries, method=spec.method, status=response.status_code):
                    self.raise_for_status(response)
                await self._sleep(self.backoff_s(attempt, response.headers.get("retry-after")))
                await response.aclose()
            attempt += 1

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

"""Client: the synchronous SDK (httpx.Client)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal, overload

import httpx

from promptcache.clients.base import DEFAULT_BASE_URL, BaseClient, RequestSpec, Stream
from promptcache.clients.types import Explanation, FidelityReport, Generation, GenerationChunk, SchemaInfo


class Schemas:
    """`client.schemas`: upload, list, get and delete PML schemas; their fidelity reports."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def create(self, pml: str, *, fidelity_report: bool = False) -> SchemaInfo:
        """Upload a schema; its modules are encoded before this returns. ConflictError if the name exists. With
        `fidelity_report=True`, `SchemaInfo.fidelity_report` has its `fidelity` report (or `fidelity_report_error`)."""
        body = BaseClient.body(pml=pml, fidelity_report=True if fidelity_report else None)
        return BaseClient.parse(self._client._send(RequestSpec("POST", "/v1/schemas", body)), SchemaInfo)

    def list(self) -> list[SchemaInfo]:
        data = self._client._send(RequestSpec("GET", "/v1/schemas")).json()["data"]
        return [SchemaInfo.model_validate(item) for item in data]

    def get(self, name: str) -> SchemaInfo:
        return BaseClient.parse(self._client._send(RequestSpec("GET", f"/v1/schemas/{name}")), SchemaInfo)

    def delete(self, name: str) -> None:
        self._client._send(RequestSpec("DELETE", f"/v1/schemas/{name}"))

    def fidelity(self, name: str, *, num_samples: int | None = None, seed: int | None = None,
                 question: str | None = None, max_imports: int | None = None, fidelity_head_tokens: int | None = None,
                 fidelity_positions: Literal["contiguous", "layout"] | None = None,
                 fidelity_context: Literal["schema", "predecessor"] | None = None) -> FidelityReport:
        """The schema's fidelity report: each mode's (exact, fast, balanced) greedy first-token agreement with a full
        prefill, its 95 % interval and KL, on `num_samples` seeded module combinations (server default 16, capped).
        Computed (seconds to minutes: raise `timeout_s`) or `cached`. `question` follows the modules (None: a generic
        one; "": none). NotFoundError for a schema this key does not see; BadRequestError past the sample limit."""
        path = BaseClient.fidelity_path(name, num_samples=num_samples, seed=seed, question=question,
                                        max_imports=max_imports, fidelity_head_tokens=fidelity_head_tokens,
                                        fidelity_positions=fidelity_positions, fidelity_context=fidelity_context)
        return BaseClient.parse(self._client._send(RequestSpec("GET", path)), FidelityReport)


class Client(BaseClient):
    """Synchronous promptcache client. Retries 429/5xx/connection errors with backoff."""

    def __init__(self, base_url: str = DEFAULT_BASE_URL, *, api_key: str | None = None, timeout_s: float = 60.0,
                 max_retries: int = 2, http_client: httpx.Client | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(base_url, api_key, timeout_s, max_retries)
        self._http = http_client or httpx.Client(timeout=timeout_s)
        self._sleep = sleep
        self.schemas = Schemas(self)

    @overload
    def generate(self, prompt: str, *, max_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, n: int | None = None,
                 stop: str | list[str] | None = None, seed: int | None = None, cache_salt: str | None = None,
                 fidelity: Literal["fast", "balanced", "exact"] | None = None, fidelity_head_tokens: int | None = None,
                 fidelity_positions: Literal["contiguous", "layout"] | None = None,
                 fidelity_context: Literal["schema", "predecessor"] | None = None,
                 return_spans: bool = False, stream: Literal[False] = False) -> Generation: ...

    @overload
    def generate(self, prompt: str, *, max_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, n: int | None = None,
                 stop: str | list[str] | None = None, seed: int | None = None, cache_salt: str | None = None,
                 fidelity: Literal["fast", "balanced", "exact"] | None = None, fidelity_head_tokens: int | None = None,
                 fidelity_positions: Literal["contiguous", "layout"] | None = None,
                 fidelity_context: Literal["schema", "predecessor"] | None = None,
                 return_spans: bool = False, stream: Literal[True]) -> Stream[GenerationChunk]: ...

    def generate(self, prompt: str, *, max_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, n: int | None = None,
                 stop: str | list[str] | None = None, seed: int | None = None, cache_salt: str | None = None,
                 fidelity: Literal["fast", "balanced", "exact"] | None = None, fidelity_head_tokens: int | None = None,
                 fidelity_positions: Literal["contiguous", "layout"] | None = None,
                 fidelity_context: Literal["schema", "predecessor"] | None = None,
                 return_spans: bool = False, stream: bool = False) -> Generation | Stream[GenerationChunk]:
        """Generate from a PML prompt (`<prompt schema="...">`); with `stream=True`, iterate chunks. `fidelity` (k:
        `fidelity_head_tokens`; `fidelity_positions`: re-aligned or layout; `fidelity_context`: which encoding of a
        module to reuse) says how module KV reused out of context is treated (None: server default).
        `return_spans=True` adds `cache.spans`: the prompt by where each token's KV came from."""
        body = self.generate_body(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                  n=n, stop=stop, seed=seed, cache_salt=cache_salt, stream=stream,
                                  fidelity=fidelity, fidelity_head_tokens=fidelity_head_tokens,
                                  fidelity_positions=fidelity_positions, fidelity_context=fidelity_context,
                                  return_spans=return_spans)
        response = self._send(RequestSpec("POST", "/v1/generate", body, stream=stream))
        return Stream(response, GenerationChunk) if stream else self.parse(response, Generation)

    def explain(self, prompt: str, cache_salt: str | None = None) -> Explanation:
        """Dry run: which modules hit and on which tier, tokens to compute, exact or not."""
        body = self.body(prompt=prompt, cache_salt=cache_salt)
        return self.parse(self._send(RequestSpec("POST", "/v1/prompts/explain", body)), Explanation)

    def health(self) -> bool:
        try:
            return self._http.get(self.base_url + "/health", timeout=self.timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def _send(self, spec: RequestSpec) -> httpx.Response:
        attempt = 0
        while True:
            request = self._http.build_request(spec.method, self.base_url + spec.path, json=spec.json,
                                               headers=self.headers())
            try:
                response = self._http.send(request, stream=spec.stream)
            except httpx.TransportError as exc:  # timeouts included
                self.raise_unless_retried(attempt, spec, exc)
                self._sleep(self.backoff_s(attempt))
            else:
                if response.status_code < 400:
                    return response
                if spec.stream:
                    response.read()
                if not self.should_retry(attempt, self.max_retries, method=spec.method, status=response.status_code):
                    self.raise_for_status(response)
                self._sleep(self.backoff_s(attempt, response.headers.get("retry-after")))
                response.close()
            attempt += 1

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Prometheus metrics with vLLM-style names (prefix `promptcache:`), one registry per app."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from promptcache.cache_store import TieredStore
from promptcache.model_runtime import RuntimeStats

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)


class Metrics:
    """Request counters the service updates, and engine and store state read at scrape time (`sources`' families)."""

    def __init__(self, model_name: str, *sources: Callable[[], Iterator]) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        self.ttft = Histogram("promptcache:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("promptcache:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             registry=self.registry)
        by_tenant = [*labels, "tenant"]  # the default tenant is "_default" (tenants.py)
        self.prompt_tokens = Counter("promptcache:prompt_tokens", "Prompt tokens processed.", by_tenant,
                                     registry=self.registry)
        self.cached_prompt_tokens = Counter("promptcache:cached_prompt_tokens", "Prompt tokens served from cache.",
                                            by_tenant, registry=self.registry)
        self.generation_tokens = Counter("promptcache:generation_tokens", "Generated tokens.", labels,
                                         registry=self.registry)
        self.reused_tokens = Counter("promptcache:reused_prompt_tokens",
                                     "Prompt tokens whose KV was reused, by kind (module | prefix) and tier.",
                                     [*by_tenant, "kind", "tier"], registry=self.registry)
        self.requests = Counter("promptcache:request_success", "Finished requests by finish reason.",
                                [*by_tenant, "finished_reason"], registry=self.registry)
        self._sources = sources
        self.registry.register(self)

    def observe(self, *, ttft_s: float, e2e_s: float, prompt_tokens: int, cached_tokens: int,
                completion_tokens: int, finish_reasons: list[str],
                reused: Sequence[tuple[str, str, int]] = (), tenant: str = "_default") -> None:
        """Record one finished request of `tenant` (its metrics label); `reused` holds (kind, tier, tokens)."""
        m = self.model_name
        self.ttft.labels(m).observe(ttft_s)
        self.e2e.labels(m).observe(e2e_s)
        self.prompt_tokens.labels(m, tenant).inc(prompt_tokens)
        self.cached_prompt_tokens.labels(m, tenant).inc(cached_tokens)
        self.generation_tokens.labels(m).inc(completion_tokens)
        for reason in finish_reasons:
            self.requests.labels(m, tenant, reason).inc()
        for kind, tier, count in reused:
            self.reused_tokens.labels(m, tenant, kind, tier).inc(count)

    def collect(self) -> Iterator:
        for source in self._sources:
            yield from source()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def engine_families(stats: RuntimeStats, model_name: str) -> Iterator:
    def family(kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, documentation: str, value: float):
        metric = kind(f"promptcache:{name}", documentation, labels=["model_name"])
        metric.add_metric([model_name], value)
        return metric

    yield family(GaugeMetricFamily, "num_requests_running", "Sequences in the running batch.", stats.num_running)
    yield family(GaugeMetricFamily, "num_requests_waiting", "Requests waiting for admission.", stats.num_waiting)
    yield family(GaugeMetricFamily, "kv_cache_usage_bytes", "KV bytes held by the running batch.", stats.kv_used_bytes)
    yield family(CounterMetricFamily, "module_encodings", "Segments encoded (cache misses in every tier).",
                 stats.num_encoded_segments)
    yield family(CounterMetricFamily, "prefix_store_seconds", "Time spent storing automatic prefix blocks.",
                 stats.prefix_store_s)


def store_families(store: TieredStore) -> Iterator:
    stats = store.stats()
    queries = CounterMetricFamily("promptcache:cache_queries", "KV lookups that reached a tier.", labels=["tier"])
    hits = CounterMetricFamily("promptcache:cache_hits", "KV lookups answered by a tier.", labels=["tier"])
    evictions = CounterMetricFamily("promptcache:cache_evictions", "Blocks evicted from a tier.", labels=["tier"])
    used = GaugeMetricFamily("promptcache:cache_usage_bytes", "Bytes held by a tier.", labels=["tier"])
    by_kind = GaugeMetricFamily("promptcache:cache_usage_by_kind_bytes", "Bytes held by a tier, by kind (module KV | "
                                "automatic prefix blocks).", labels=["tier", "kind"])
    for tier in stats.tiers:
        queries.add_metric([tier.name], tier.hits + tier.misses)
        hits.add_metric([tier.name], tier.hits)
        evictions.add_metric([tier.name], tier.evictions)
        used.add_metric([tier.name], tier.used_bytes)
        by_kind.add_metric([tier.name, "module"], tier.module_bytes)
        by_kind.add_metric([tier.name, "prefix"], tier.prefix_bytes)
    yield from (queries, hits, evictions, used, by_kind)

"""Server settings: the only place that reads the environment (prefix PROMPTCACHE_), and the one mapping from them to
the model, store, engine and PML configs (the server, the CLI and the cluster replicas use it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

if TYPE_CHECKING:
    from collections.abc import Mapping

    from promptcache.cache_store import StoreConfig
    from promptcache.model_runtime import EngineConfig, Fidelity, ModelConfig
    from promptcache.pml import PmlLimits


class ServerSettings(BaseSettings):
    """Every knob of a server: `PROMPTCACHE_<NAME>` variables set them; CLI flags (keyword arguments) override."""

    model_config = SettingsConfigDict(env_prefix="PROMPTCACHE_", extra="ignore")

    model: str | None = Field(None, description="HF model path or hub id, a .gguf file, or a short name "
                              "(smollm2-135m, gemma3-270m); None serves SmolLM2-135M-Instruct")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="auto: bf16 where native")
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Bearer keys; empty: no auth")
    api_keys_file: str | None = Field(None, description="JSON mapping API keys to tenant names (docs/security.md)")
    metrics_key: str | None = Field(None, description="Bearer key /metrics asks for; None: /metrics is open, or closed "
                                                      "when an API keys file is set (its series name tenants)")
    tenant_max_schemas: int | None = Field(None, ge=0, description="schemas per tenant; None: unlimited")
    tenant_max_schema_tokens: int | None = Field(None, ge=0, description="schema positions summed per tenant")
    tenant_rate_limit: str | None = Field(None, description="samples (prompts x n) per tenant, e.g. '10/second'")
    tenant_cache_share: float | None = Field(None, gt=0, le=1, description="most of each KV tier one tenant holds")
    redis_url: str | None = Field(None, description="redis:// or rediss:// (TLS), optionally user:password@")
    blob_key: str | None = Field(None, min_length=16, repr=False, description="HMAC key of all Redis data")
    namespace: str = "default"
    device_max_bytes: int | None = Field(None, gt=0, description="device KV tier budget; None: 1 GiB on a CPU, "
                                                                  "a quarter of a GPU's free memory at startup")
    host_max_bytes: int = 4 << 30
    redis_max_bytes: int = 8 << 30
    redis_timeout_s: float = 0.5
    disk_dir: str | None = None
    disk_max_bytes: int = 16 << 30
    max_num_seqs: int = 64
    tenant_headroom_seqs: int = Field(8, ge=0, description="with an API keys file: sequence slots one tenant "
                                      "leaves free for the others' requests; 0: none")
    tenant_kv_share: float = Field(0.5, ge=0, le=1, description="with an API keys file: the most of max_kv_bytes one "
                                   "tenant's requests and module encodings hold while others wait; 0: no bound")
    shared_step_ratio: float = Field(1.0, ge=0, description="while a light tenant is served beside busy ones, "
                                     "their steps are held to this many times its step of its own; 0: no cap")
    max_kv_bytes: int = 2 << 30
    max_waiting_per_tenant: int = Field(1024, ge=1, description="requests one tenant may have waiting for "
                                        "admission (prompts of a list count one each); more get 429 + Retry-After")
    max_prefill_tokens: int = Field(256, ge=1, description="most prompt/encoding tokens a step while others decode")
    min_prefill_tokens: int = Field(8, ge=1, description="least prompt/encoding tokens a step while others decode")
    max_step_slowdown: float = Field(1.6, ge=0, description="a step with prompt tokens costs at most this many "
                                                           "decode-only steps (learned); 0: fixed chunks")
    ttft_target_ms: float = Field(0, ge=0, description="while others decode, a step also feeds the prompts "
                                  "that would get their first token later than this (ms); 0: off")
    max_prefill_tokens_alone: int = Field(4096, ge=1, description="prompt/encoding tokens per step otherwise")
    attention_backend: str = "auto"
    max_request_bytes: int = 2 << 20
    max_schema_bytes: int = 4 << 20
    max_tokens_limit: int = 4096
    max_prompts_per_request: int = Field(256, ge=1, le=4096, description="prompts one /v1/completions request may list")
    prefix_caching: bool = True
    prefix_block_size: int = Field(32, ge=1, le=4096, description="tokens per automatic prefix block")
    prefix_ttl_s: float | None = Field(None, gt=0, description="unused prefix blocks expire after this")
    logits_cache_bytes: int = Field(32 << 20, ge=0, description="last-token logits kept so an exact repeat runs "
                                                               "no forward pass; 0: off")
    max_assembled_kv_bytes: int = Field(128 << 20, ge=0, description="concatenated shared KV (a document's prefix "
                                        "blocks, a module set) kept for the next request over them; 0: while in use")
    # The fidelity_* defaults are the evaluation's picks: docs/fidelity.md
    fidelity: Literal["fast", "balanced", "exact"] = Field("exact", description="mode of requests that name none")
    fidelity_head_tokens: int = Field(16, ge=0, le=4096, description="balanced mode: tokens recomputed at the start "
                                                                     "of each module reused outside its context")
    fidelity_positions: Literal["contiguous", "layout"] = Field("contiguous", description="fast/balanced: where a "
                                                                "prompt's tokens sit (reused keys re-aligned, or gaps)")
    fidelity_context: Literal["schema", "predecessor"] = Field("predecessor", description="fast/balanced: reuse a "
                                                               "module's KV encoded after its schema context or also "
                                                               "after the module before it (a second KV per module)")
    second_encodings_at_upload: bool = Field(False, description="an upload also encodes each module's second KV "
                                             "(fidelity_context predecessor), not on the module's first such use")
    upload_kv_local: bool = Field(True, description="an upload keeps the KV it encodes in this process's tiers too; "
                                  "False: shared tiers only (a cluster's replica taking an upload rarely serves it)")
    registry_poll_s: float = Field(1.0, gt=0, description="how often replicas check the shared schema registry")
    heap_trim_s: float = Field(5.0, ge=0, description="how often freed heap memory is returned to the OS; 0: never")
    preload_examples: bool = True
    model_cache_dir: str | None = None
    pack_weights: bool = Field(True, description="linear weights prepacked for oneDNN on CPU (same results)")
    fuse_layers: bool = Field(True, description="fused decoder layers on a GPU, and in bf16 on CPUs with "
                                                "AVX512-BF16 (same outputs; off: the HF modules)")
    weights: Literal["auto", "native", "int8", "int4"] = Field("auto", description="CPU: decoder linear weights as "
                                                               "loaded, int8 per channel or int4 per 32-group; auto: "
                                                               "int4 for a 4-bit GGUF, else native (docs/api.md)")
    cuda_graphs: bool = Field(True, description="a GPU's all-decode steps and lone prefills of <= 256 tokens "
                              "replayed from CUDA graphs (bf16/fp16 with Triton; same results as eager up to rounding)")
    deterministic: bool = Field(False, description="batch-invariant kernels: a request and seed give the same tokens "
                                "whatever the cache state and the batch (CPU, fp32/bf16, native weights; docs/api.md)")

    def load_config(self) -> ModelConfig:
        """The model these settings serve, as the runtime loads it."""
        from promptcache.model_runtime import ModelConfig, WeightFormat

        return ModelConfig(self.model, dtype=self.dtype, device=self.device, cache_dir=self.model_cache_dir,
                           pack_weights=self.pack_weights, fuse_layers=self.fuse_layers,
                           weights=WeightFormat(self.weights), deterministic=self.deterministic)

    def store_config(self, owner_shares: Mapping[str, float] | None = None) -> StoreConfig:
        """The KV store of server and `promptcache encode` alike; `owner_shares`: each tenant's share of each tier."""
        from promptcache.cache_store import StoreConfig

        return StoreConfig(
            device_max_bytes=self.device_max_bytes, host_max_bytes=self.host_max_bytes, redis_url=self.redis_url,
            redis_max_bytes=self.redis_max_bytes, redis_namespace=self.namespace, redis_timeout_s=self.redis_timeout_s,
            disk_dir=self.disk_dir, disk_max_bytes=self.disk_max_bytes,
            blob_key=self.blob_key.encode() if self.blob_key else None,
            owner_shares=tuple((owner_shares or {}).items()))

    def engine_config(self) -> EngineConfig:
        """The batch engine these settings describe."""
        from promptcache.cache_store import BlockIndexConfig
        from promptcache.model_runtime import EngineConfig

        return EngineConfig(
            max_num_seqs=self.max_num_seqs, max_kv_bytes=self.max_kv_bytes, attention_backend=self.attention_backend,
            prefix=BlockIndexConfig(self.prefix_block_size, ttl_s=self.prefix_ttl_s) if self.prefix_caching else None,
            fidelity=self.default_fidelity(), max_prefill_tokens=self.max_prefill_tokens,
            max_prefill_tokens_alone=self.max_prefill_tokens_alone, min_prefill_tokens=self.min_prefill_tokens,
            max_step_slowdown=self.max_step_slowdown or None, ttft_target_ms=self.ttft_target_ms or None,
            logits_cache_bytes=self.logits_cache_bytes, shared_step_ratio=self.shared_step_ratio or None,
            max_assembled_bytes=self.max_assembled_kv_bytes, max_waiting_per_tenant=self.max_waiting_per_tenant,
            cuda_graphs=self.cuda_graphs, reserve_assembled=True,
            # Headroom is for other tenants: only an API keys file makes several.
            tenant_headroom_seqs=min(self.tenant_headroom_seqs, self.max_num_seqs - 1) if self.api_keys_file else 0,
            tenant_kv_share=(self.tenant_kv_share or None) if self.api_keys_file else None)

    def default_fidelity(self) -> Fidelity:
        """The fidelity of requests that name none."""
        from promptcache.model_runtime import ContextMode, Fidelity, FidelityMode, PositionMode

        return Fidelity(FidelityMode(self.fidelity), self.fidelity_head_tokens, PositionMode(self.fidelity_positions),
                        ContextMode(self.fidelity_context))

    def pml_limits(self) -> PmlLimits:
        """The bounds on PML documents: a schema's bytes, a prompt's (the request limit)."""
        from promptcache.pml import PmlLimits

        return PmlLimits(max_schema_bytes=self.max_schema_bytes, max_prompt_bytes=self.max_request_bytes)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value):
        if isinstance(value, str):  # PROMPTCACHE_API_KEYS="k1,k2"
            keys = [k.strip() for k in value.split(",") if k.strip()]
            if value.strip() and not keys:  # "," meant keys and holds none: refused, never an open server
                raise ValueError(f"PROMPTCACHE_API_KEYS={value!r} lists no API key; give comma-separated keys, "
                                 "or unset it for a server without authentication")
            return keys
        return value

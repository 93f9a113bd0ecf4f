"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from promptcache.cache_store import BlockIndexConfig
from promptcache.model_runtime.engine.reuse_plan import Fidelity
from promptcache.model_runtime.errors import require


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Limits of the batch engine. `max_kv_bytes` bounds the running batch's KV: each sequence's own (computed prompt
    plus `max_tokens`) and each shared block once. `prefix`: prefix reuse (None: off); `fidelity`: the default mode.
    Prefills and encodings advance in chunks: `max_prefill_tokens_alone` a step when nothing decodes, else within
    `max_step_slowdown` times a decode-only step (None: `max_prefill_tokens`), between `min_prefill_tokens` and
    `max_prefill_tokens`; with `ttft_target_ms`, also every prompt that would get its first token later at that budget
    (and those queued before it). `logits_cache_bytes`: last-token logits kept for exact repeats (0: off).
    `max_waiting_per_tenant`: queued requests per tenant before QueueFullError. A tenant running `max_num_seqs -
    tenant_headroom_seqs` sequences takes no more, nor one holding `tenant_kv_share` of `max_kv_bytes` (its requests'
    KV and its module encodings') while another tenant waits (None: no bound). Within `shared_window_s` of a light
    tenant's own step, others' steps are held to `shared_step_ratio` times it (None: no cap). `cuda_graphs`:
    uniform steps of a bf16/fp16 CUDA model replayed from CUDA graphs (engine/cuda_graphs.py); off: all eager.
    `reserve_assembled`: on a CPU, `max_assembled_bytes` allocated and touched when the engine starts, so that the first
    assembled group does not pay for first touches of fresh memory (kv_groups.AssembledGroups.reserve)."""

    max_num_seqs: int = 64
    max_kv_bytes: int = 2 << 30
    attention_backend: str = "auto"  # "auto" | "fused_cpu" | "matmul" | "flash"
    idle_wait_s: float = 0.05
    prefix: BlockIndexConfig | None = field(default_factory=BlockIndexConfig)
    fidelity: Fidelity = field(default_factory=Fidelity)
    max_prefill_tokens: int = 256
    max_prefill_tokens_alone: int = 4096
    min_prefill_tokens: int = 8
    max_step_slowdown: float | None = 1.6
    ttft_target_ms: float | None = None
    logits_cache_bytes: int = 32 << 20  # ~170 prompts of a 49K-token vocabulary
    max_assembled_bytes: int = 128 << 20  # ~5.6K tokens of SmolLM2-135M's KV in bf16
    max_waiting_per_tenant: int = 1024  # 16 full batches of the default max_num_seqs
    tenant_headroom_seqs: int = 0
    tenant_kv_share: float | None = None
    shared_step_ratio: float | None = 1.0
    shared_window_s: float = 2.0
    cuda_graphs: bool = True
    reserve_assembled: bool = False

    def __post_init__(self) -> None:
        require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        require(0 <= self.tenant_headroom_seqs < self.max_num_seqs,
                f"tenant_headroom_seqs must be in [0, max_num_seqs), got {self.tenant_headroom_seqs}")
        require(self.tenant_kv_share is None or 0 < self.tenant_kv_share <= 1,
                f"tenant_kv_share must be in (0, 1] or None, got {self.tenant_kv_share}")
        require(self.max_waiting_per_tenant >= 1,
                f"max_waiting_per_tenant must be >= 1, got {self.max_waiting_per_tenant}")
        require(self.max_assembled_bytes >= 0, f"max_assembled_bytes must be >= 0, got {self.max_assembled_bytes}")
        require(self.max_kv_bytes >= 1, f"max_kv_bytes must be >= 1, got {self.max_kv_bytes}")
        require(1 <= self.max_prefill_tokens <= self.max_prefill_tokens_alone and self.min_prefill_tokens >= 1,
                f"need 1 <= max_prefill_tokens <= max_prefill_tokens_alone and min_prefill_tokens >= 1, got "
                f"{self.max_prefill_tokens}, {self.max_prefill_tokens_alone} and {self.min_prefill_tokens}")
        require(not (self.max_step_slowdown is not None and self.max_step_slowdown <= 1.0),
                f"max_step_slowdown must be > 1 or None, got {self.max_step_slowdown}")
        require(self.ttft_target_ms is None or self.ttft_target_ms > 0,
                f"ttft_target_ms must be > 0 or None, got {self.ttft_target_ms}")
        require(not (self.shared_step_ratio is not None and self.shared_step_ratio <= 0),
                f"shared_step_ratio must be > 0 or None, got {self.shared_step_ratio}")
        require(self.attention_backend in ("auto", "fused_cpu", "matmul", "flash"),
                f"unknown attention_backend {self.attention_backend!r}")

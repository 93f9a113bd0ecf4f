"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from promptcache.cache_store import BlockIndexConfig
from promptcache.model_runtime.engine.reuse_plan import Fidelity


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Limits of the batch engine.

    `max_kv_bytes` bounds the KV the running batch holds: every sequence's own KV (its computed prompt
    tokens plus room for `max_tokens`) and, once each, every shared module or prefix block it references.
    `prefix` configures automatic prefix reuse (docs/architecture.md); None turns it off. `fidelity` is the
    mode of requests that name none (docs/fidelity.md). Prompt prefills and module encodings advance
    in chunks: `max_prefill_tokens_alone` tokens a step when nothing decodes; while something decodes,
    as many as keep a step within `max_step_slowdown` times a decode-only step (learned from step
    times, engine/step_budget.py), between `min_prefill_tokens` (capped at `max_prefill_tokens`) and
    `max_prefill_tokens`. With `max_step_slowdown` None, always `max_prefill_tokens`. With
    `ttft_target_ms`, a step also feeds every prompt that would get its first token after that target
    at the learned budget (and the prompts queued before it), up to `max_prefill_tokens`.
    `logits_cache_bytes` keeps the last-token logits of recent prompts so an exact repeat whose KV is all
    stored runs no forward pass before its first token (engine/prefix.py); 0 turns that off.
    `max_waiting_per_tenant` bounds the requests one tenant has submitted and not yet admitted; past it,
    `submit` raises QueueFullError (engine/waiting.py). `tenant_headroom_seqs` sequence slots are ones a
    tenant cannot take while it already runs `max_num_seqs - tenant_headroom_seqs` sequences: they stay
    free for other tenants, so one tenant's full batch does not make another's request wait for it to
    drain (0: no headroom, as on a single-tenant server). Within `shared_window_s` of a step that a light
    tenant's prompt got of its own (engine/step_plan.py), the others' steps are held to
    `shared_step_ratio` times such a step (learned from step times, engine/shared_step.py): decodes take
    turns and prompt tokens fill what is left, so a light tenant's first token waits for a short step
    of another's, not a full batch. None: no cap.
    """

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
    shared_step_ratio: float | None = 1.0
    shared_window_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0 <= self.tenant_headroom_seqs < self.max_num_seqs:
            raise ValueError(f"tenant_headroom_seqs must be in [0, max_num_seqs), got {self.tenant_headroom_seqs}")
        if self.max_waiting_per_tenant < 1:
            raise ValueError(f"max_waiting_per_tenant must be >= 1, got {self.max_waiting_per_tenant}")
        if self.max_assembled_bytes < 0:
            raise ValueError(f"max_assembled_bytes must be >= 0, got {self.max_assembled_bytes}")
        if self.max_kv_bytes < 1:
            raise ValueError(f"max_kv_bytes must be >= 1, got {self.max_kv_bytes}")
        if not 1 <= self.max_prefill_tokens <= self.max_prefill_tokens_alone or self.min_prefill_tokens < 1:
            raise ValueError(f"need 1 <= max_prefill_tokens <= max_prefill_tokens_alone and min_prefill_tokens >= 1, "
                             f"got {self.max_prefill_tokens}, {self.max_prefill_tokens_alone} and "
                             f"{self.min_prefill_tokens}")
        if self.max_step_slowdown is not None and self.max_step_slowdown <= 1.0:
            raise ValueError(f"max_step_slowdown must be > 1 or None, got {self.max_step_slowdown}")
        if self.ttft_target_ms is not None and self.ttft_target_ms <= 0:
            raise ValueError(f"ttft_target_ms must be > 0 or None, got {self.ttft_target_ms}")
        if self.shared_step_ratio is not None and self.shared_step_ratio <= 0:
            raise ValueError(f"shared_step_ratio must be > 0 or None, got {self.shared_step_ratio}")
        if self.attention_backend not in ("auto", "fused_cpu", "matmul", "flash"):
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}")

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
    `prefix` configures automatic prefix reuse (design.md §4a); None turns it off. `fidelity` is the
    mode of requests that name none (design.md §4b). Prompt prefills and module encodings advance
    in chunks: at most `max_prefill_tokens` tokens a step while any sequence decodes (the stall a
    long prompt may cause every stream), `max_prefill_tokens_alone` when nothing decodes.
    """

    max_num_seqs: int = 64
    max_kv_bytes: int = 2 << 30
    attention_backend: str = "auto"  # "auto" | "fused_cpu" | "matmul" | "flash"
    idle_wait_s: float = 0.05
    prefix: BlockIndexConfig | None = field(default_factory=BlockIndexConfig)
    fidelity: Fidelity = field(default_factory=Fidelity)
    max_prefill_tokens: int = 64
    max_prefill_tokens_alone: int = 4096

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_kv_bytes < 1:
            raise ValueError(f"max_kv_bytes must be >= 1, got {self.max_kv_bytes}")
        if not 1 <= self.max_prefill_tokens <= self.max_prefill_tokens_alone:
            raise ValueError(f"need 1 <= max_prefill_tokens <= max_prefill_tokens_alone, got "
                             f"{self.max_prefill_tokens} and {self.max_prefill_tokens_alone}")
        if self.attention_backend not in ("auto", "fused_cpu", "matmul", "flash"):
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}")

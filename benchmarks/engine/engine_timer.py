"""In-process timing through the engine the server runs (the one path from plan to tokens)."""

from __future__ import annotations

import asyncio
import time

from promptcache.cache_store import BlockIndexConfig
from promptcache.model_runtime import ModelRuntime, SamplingParams
from promptcache.model_runtime.engine import Engine, EngineConfig, TokenEvent
from promptcache.pml import PromptPlan


class EngineTimer:
    """Submits plans to an Engine and times the first token. `prefix=None` measures module caching
    alone (a repeated prompt would otherwise reuse its own new text)."""

    def __init__(self, runtime: ModelRuntime, *, prefix: BlockIndexConfig | None = None,
                 max_kv_bytes: int = 8 << 30, cuda_graphs: bool = True) -> None:
        self.engine = Engine(runtime.module_encoder, EngineConfig(prefix=prefix, max_kv_bytes=max_kv_bytes,
                                                                  cuda_graphs=cuda_graphs))

    def first_token(self, plan: PromptPlan) -> tuple[int, float, TokenEvent]:
        """(greedy first token, submit-to-token ms, final event) for one request with max_tokens=1."""

        async def run() -> tuple[int, float, TokenEvent]:
            started = time.perf_counter()
            token, elapsed, final = None, 0.0, None
            async for event in self.engine.submit(plan, SamplingParams(max_tokens=1, temperature=0)):
                if event.report is not None and event.report.error is not None:
                    raise RuntimeError(event.report.error)
                if token is None and event.token_id is not None:
                    token, elapsed = event.token_id, (time.perf_counter() - started) * 1e3
                if event.report is not None:
                    final = event
            assert token is not None and final is not None
            return token, elapsed, final

        return asyncio.run(run())

    def close(self) -> None:
        self.engine.stop()

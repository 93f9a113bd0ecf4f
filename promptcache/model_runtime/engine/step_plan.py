"""Which sequences a step runs, and how many prompt tokens each feeds: the scheduler's batch policy."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from promptcache.model_runtime.engine.request import SeqStatus, Sequence


def compose_step(running: Seq[Sequence], *, mixed_budget: int, alone_budget: int) -> tuple[list[Sequence], int]:
    """The step's batch (setting each prefill's `step_len`) and the prefill budget it leaves.

    - Decoding sequences always run, and prefills share `mixed_budget` tokens with them (so no stream
      stalls for a long prompt); with nothing decoding, prefills share `alone_budget`.
    - Prefills of tenants with fewer running sequences are fed first (admission order within a tenant):
      a tenant flooding the engine has many prefills in flight, and in admission order alone another
      tenant's short prompt would wait for all of them to be fed, chunk by chunk.
    - A tenant with nothing decoding whose prompts fit `alone_budget` whole gets a step of its own while
      others decode: its first token then waits for one short step rather than for a full batch step
      of the busy tenant. Each such step delays the others' next token once; a tenant gets it only
      while none of its sequences decodes, so it cannot hold the others back for long.
    """
    decoding = [s for s in running if s.pending_ids and s.status != SeqStatus.PREFILL]
    prefills = _by_tenant_load(running)
    busy = {s.request.tenant for s in decoding}
    light = [s for s in prefills if s.request.tenant not in busy]
    if decoding and light and sum(len(s.pending_ids) for s in light) <= alone_budget:
        for seq in light:
            seq.step_len = len(seq.pending_ids)
        return light, alone_budget - sum(s.step_len for s in light)
    budget = mixed_budget if decoding else alone_budget
    batch = list(decoding)
    for seq in prefills:
        if budget <= 0:
            break
        seq.step_len = min(len(seq.pending_ids), budget)
        budget -= seq.step_len
        batch.append(seq)
    return batch, budget


def _by_tenant_load(running: Seq[Sequence]) -> list[Sequence]:
    """Sequences with prompt tokens to feed, tenants with fewer running sequences first."""
    load: dict[str | None, int] = {}
    for seq in running:
        load[seq.request.tenant] = load.get(seq.request.tenant, 0) + 1
    prefills = [s for s in running if s.status == SeqStatus.PREFILL and s.pending_ids]
    return sorted(prefills, key=lambda s: load[s.request.tenant])  # stable: admission order kept

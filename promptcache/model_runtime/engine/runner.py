"""ModelRunner: one packed forward pass for a scheduled batch; returns next-token logits per sequence."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence as Seq

import torch

from promptcache.model_runtime.attention import bf16_kernel
from promptcache.model_runtime.attention.step_indices import to_device
from promptcache.model_runtime.engine.kv_groups import AssembledGroups
from promptcache.model_runtime.engine.request import SeqStatus, Sequence
from promptcache.model_runtime.forward import cache_argument
from promptcache.model_runtime.loader import LoadedModel
from promptcache.model_runtime.packed_attention import BatchCache, BatchContext, active_batch, install
from promptcache.model_runtime.sampling import TokenLogprobs, token_logprobs

_LOGPROB_ROWS = 256  # prompt rows scored per lm_head call: bounds the [rows, vocab] logits in memory


class ModelRunner:
    """Runs batch steps. Shared segments are grouped by the exact set of sequences that use them; a
    group of several blocks is concatenated once and kept for later steps and requests (AssembledGroups,
    `max_assembled_bytes` once unused)."""

    def __init__(self, loaded: LoadedModel, *, backend: str = "auto", max_assembled_bytes: int = 128 << 20) -> None:
        self.loaded = loaded
        self.backend = backend
        self.groups = AssembledGroups(max_assembled_bytes, loaded.key_shifter)
        install(loaded.model)
        if backend == "auto" and loaded.model.dtype == torch.bfloat16 and loaded.model.device.type == "cpu":
            bf16_kernel.prepare()  # built here, at startup, never inside a request

    @torch.inference_mode()
    def run(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """Feed each sequence's next `step_len` pending tokens (all of them when 0: a chunk of a long
        prefill otherwise); returns logits [num_seqs, vocab] (float32) for the last token fed. Only
        after the pass succeeded: advances own KV lengths and drops the fed tokens from pending."""
        model = self.loaded.model
        device = model.device
        query_lens = [s.step_len or len(s.pending_ids) for s in seqs]
        # Step inputs are built on the host and copied without blocking it (pinned, on a GPU).
        input_ids = to_device(torch.tensor([[t for s, n in zip(seqs, query_lens) for t in s.pending_ids[:n]]],
                                           dtype=torch.long), device)  # [1, Q]
        positions = to_device(torch.tensor([[p for s, n in zip(seqs, query_lens) for p in s.pending_positions[:n]]],
                                           dtype=torch.long), device)  # [1, Q]
        # Sequences whose own KV lives in one pool get their new KV written with one index_copy_ per layer.
        pool = next((s.own_pool for s in seqs if s.own_pool is not None), None)
        context = BatchContext(
            query_lens=query_lens, own_keys=[s.own_keys for s in seqs], own_values=[s.own_values for s in seqs],
            own_starts=[s.own_length for s in seqs], segments=self._segments(seqs), backend=self.backend,
            pool=pool, own_slots=[s.own_slot if pool is not None and s.own_pool is pool else None for s in seqs])
        cache = BatchCache(context, self.loaded.num_layers)
        with active_batch(context):
            hidden = model.base_model(input_ids=input_ids, position_ids=positions, use_cache=True,
                                      **cache_argument(model.base_model, cache)).last_hidden_state  # [1, Q, hidden]
        last_rows = to_device(torch.tensor(query_lens).cumsum(0) - 1, device)  # [num_seqs]
        logits = model.get_output_embeddings()(hidden[0, last_rows]).float()  # [num_seqs, vocab]
        prompt_logprobs = self._prompt_logprobs(seqs, query_lens, hidden[0])
        for seq, found in prompt_logprobs:
            seq.request.prompt_logprobs.extend(found)
        for seq, n in zip(seqs, query_lens):
            seq.own_length += n
            seq.pending_ids, seq.pending_positions = seq.pending_ids[n:], seq.pending_positions[n:]
            if seq.status == SeqStatus.PREFILL:
                seq.prefill_done += n
            seq.step_len = 0
        return logits

    def _prompt_logprobs(self, seqs: Seq[Sequence], query_lens: list[int],
                         hidden: torch.Tensor) -> list[tuple[Sequence, list[TokenLogprobs]]]:
        """For prefilling sequences whose request wants prompt logprobs: each fed token's row scores the
        next prompt token (the last prompt token has none to score). hidden [Q, hidden_size]."""
        found, start = [], 0
        for seq, n in zip(seqs, query_lens):
            request = seq.request
            if request is not None and request.prompt_logprobs is not None and seq.status == SeqStatus.PREFILL:
                following = seq.pending_ids[1: n + 1]  # the prompt token each row predicts
                num_top = request.params.prompt_logprobs or 0
                rows: list[TokenLogprobs] = []
                for first in range(0, len(following), _LOGPROB_ROWS):  # bounded [rows, vocab] at a time
                    chunk = following[first: first + _LOGPROB_ROWS]
                    scores = self.loaded.model.get_output_embeddings()(
                        hidden[start + first: start + first + len(chunk)]).float()  # [rows, vocab]
                    rows += [token_logprobs(row, token, num_top) for row, token in zip(scores, chunk)]
                found.append((seq, rows))
            start += n
        return found

    def _segments(self, seqs: Seq[Sequence]):
        users: dict[str, list[tuple[int, int]]] = defaultdict(list)
        blocks, shifts = {}, {}
        for index, seq in enumerate(seqs):
            for shared in seq.shared:
                # Row offsets only matter in a prefill step (tokens positioned before the block),
                # counted from this chunk's first token; a sequence whose every token of this step
                # precedes the block skips it.
                offset = max(0, shared.visible_from - seq.prefill_done) if seq.status == SeqStatus.PREFILL else 0
                if offset < (seq.step_len or len(seq.pending_ids)):
                    users[shared.key].append((index, offset))
                    blocks[shared.key] = shared.block
                    shifts[shared.key] = shared.shift
        # Attention over shared KV is permutation-invariant, so every block used by the same set of
        # (sequence, offset) pairs joins one segment, wherever its positions are.
        by_users: dict[tuple[tuple[int, int], ...], list[str]] = defaultdict(list)
        for key, pairs in users.items():
            by_users[tuple(pairs)].append(key)
        segments = []
        for pairs, keys in by_users.items():
            indices = tuple(i for i, _ in pairs)
            offsets = tuple(o for _, o in pairs) if any(o for _, o in pairs) else None
            for part in self.groups.split(keys):
                keys_cat, values_cat = self.groups.get(part, blocks, shifts)  # [num_layers, num_kv_heads, sum n, head_dim]
                segments.append((keys_cat, values_cat, indices, offsets))
        self.groups.trim()
        return segments

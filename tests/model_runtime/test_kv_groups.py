"""AssembledGroups against torch.cat (the oracle), its budget, and its reuse across engine requests."""

from __future__ import annotations

import pytest
import torch

from promptcache.cache_store import KVBlock
from promptcache.model_runtime.engine.kv_groups import AssembledGroups
from promptcache.model_runtime.engine.prefix import KVView
from promptcache.pml import token_plan
from tests.model_runtime.test_prefix_reuse import TEXT, Harness, _greedy

LAYERS, HEADS, DIM = 2, 2, 4


def _blocks(*sizes: int, dtype: torch.dtype = torch.float32) -> dict[KVView, KVBlock]:
    torch.manual_seed(sum(sizes))
    return {KVView(f"b{i}"): KVBlock(torch.randn(LAYERS, HEADS, n, DIM, dtype=dtype),
                             torch.randn(LAYERS, HEADS, n, DIM, dtype=dtype), torch.arange(n))
            for i, n in enumerate(sizes)}


def _bytes(tokens: int) -> int:  # a group buffer of `tokens` tokens (keys and values, fp32, with headroom)
    return int(LAYERS * HEADS * tokens * DIM * 1.25) * 2 * 4


def test_a_group_is_the_concatenation_of_its_blocks_and_is_kept():
    blocks = _blocks(3, 5, 2)
    groups = AssembledGroups(max_bytes=1 << 20)
    names = (KVView("b0"), KVView("b1"), KVView("b2"))
    keys, values = groups.get(names, blocks)
    assert torch.equal(keys, torch.cat([blocks[n].keys for n in names], dim=2)) and keys.is_contiguous()
    assert torch.equal(values, torch.cat([blocks[n].values for n in names], dim=2))
    groups.trim()
    again, _ = groups.get(names, blocks)
    assert again.data_ptr() == keys.data_ptr()  # not copied again
    single, _ = groups.get((KVView("b1"),), blocks)
    assert single is blocks[KVView("b1")].keys and len(groups) == 1  # one block: its own tensor


def test_a_groups_positions_are_its_blocks_moved_by_their_shifts_and_kept_with_it():
    blocks = _blocks(3, 5, 2)
    blocks = {KVView(n.key, shift=shift): b for (n, b), shift in zip(blocks.items(), (0, 7, -2))}
    names = tuple(blocks)
    expected = torch.cat([torch.arange(3), torch.arange(5) + 7, torch.arange(2) - 2])
    groups = AssembledGroups(max_bytes=1 << 20, shifter=_NoShift())
    assert torch.equal(groups.positions(names, blocks), expected)  # no group yet: computed, not kept
    groups.get(names, blocks)
    first = groups.positions(names, blocks)
    assert torch.equal(first, expected) and groups.positions(names, blocks) is first  # kept with the group
    one = (names[1],)
    assert torch.equal(groups.positions(one, blocks), torch.arange(5) + 7)


class _NoShift:
    """A stand-in KeyShifter: copies keys unmoved (this test reads positions, not keys)."""

    def shift_into(self, target: torch.Tensor, keys: torch.Tensor, shifts: torch.Tensor) -> None:
        target.copy_(keys)


def test_whole_blocks_are_split_from_views():
    a5, a03, b, c = KVView("a", 0, 5), KVView("a", 0, 3), KVView("b"), KVView("c")
    assert AssembledGroups.split([c, a5, b]) == [(b, c), (a5,)]
    assert AssembledGroups.split([c, a03]) == [(a03, c)]  # one whole block: kept together
    assert AssembledGroups.split([c, b]) == [(b, c)]
    assert AssembledGroups.split([c, KVView("b", shift=2), b]) == [(b, c), (KVView("b", shift=2),)]


def test_unused_groups_are_dropped_least_recent_first_and_used_ones_never():
    blocks = _blocks(4, 4, 4, 4)
    groups = AssembledGroups(max_bytes=_bytes(8) * 2)  # room for two groups of two blocks
    groups.get((KVView("b0"), KVView("b1")), blocks)
    groups.trim()
    groups.get((KVView("b2"), KVView("b3")), blocks)
    groups.trim()
    groups.get((KVView("b0"), KVView("b2")), blocks)  # over budget: the least recent unused group gives up its buffer
    groups.get((KVView("b1"), KVView("b3")), blocks)
    groups.trim()  # both in use this step: kept though over budget
    assert len(groups) == 2 and groups.num_bytes <= groups.max_bytes
    keys, _ = groups.get((KVView("b1"), KVView("b3")), blocks)
    assert torch.equal(keys, torch.cat([blocks[KVView("b1")].keys, blocks[KVView("b3")].keys], dim=2))


def test_a_new_group_at_the_budget_reuses_an_old_buffer():
    blocks = _blocks(4, 4, 4, 3)
    groups = AssembledGroups(max_bytes=_bytes(8))
    first, _ = groups.get((KVView("b0"), KVView("b1")), blocks)
    pointer = first.data_ptr()
    groups.trim()
    keys, values = groups.get((KVView("b2"), KVView("b3")), blocks)  # 7 tokens fit the 8-token buffer: taken over
    assert keys.data_ptr() == pointer and len(groups) == 1
    assert torch.equal(keys, torch.cat([blocks[KVView("b2")].keys, blocks[KVView("b3")].keys], dim=2))
    assert torch.equal(values, torch.cat([blocks[KVView("b2")].values, blocks[KVView("b3")].values], dim=2))


def test_zero_budget_keeps_groups_only_while_used():
    blocks = _blocks(2, 2)
    groups = AssembledGroups(max_bytes=0)
    groups.get((KVView("b0"), KVView("b1")), blocks)
    groups.trim()
    assert len(groups) == 1  # used in the step that just ran
    groups.trim()
    assert len(groups) == 0
    with pytest.raises(ValueError, match="max_bytes"):
        AssembledGroups(max_bytes=-1)


def test_requests_over_one_document_attend_one_kept_group():
    h = Harness(block_size=8)
    try:
        document = h.ids(TEXT)[:45]  # five whole blocks, and a partial sixth that differs per question
        questions = [" Who sleeps?", " Where does the river flow?", " What is brewed?"]
        plans = [token_plan(h.plain, document + h.ids(q)) for q in questions]
        h.run_sync(plans[0], _greedy())
        groups = h.engine.runner.groups
        for plan in plans[1:]:
            tokens, final = h.run_sync(plan, _greedy())
            assert tokens[0] == h.oracle(plan, _greedy())  # the no-reuse oracle
            assert final.report.usage.cached_tokens >= 40
        whole = [names for names in groups.kept() if all(n.is_whole for n in names)]
        assert len(whole) == 1 and len(whole[0]) == 5  # the document's five blocks, assembled once
    finally:
        h.engine.stop()


def test_groups_are_carved_from_the_reserve_until_it_runs_out():
    blocks = _blocks(4, 4, 4, 4)
    groups = AssembledGroups(max_bytes=_bytes(8) * 2 + _bytes(4))  # two groups of two blocks, not a third
    groups.reserve(torch.float32, torch.device("cpu"))
    reserve = groups._reserve
    assert reserve is not None and not bool(reserve.any())  # touched: written through once
    storage = reserve.untyped_storage().data_ptr()
    first_names, second_names = (KVView("b0"), KVView("b1")), (KVView("b2"), KVView("b3"))
    first, _ = groups.get(first_names, blocks)
    second, second_values = groups.get(second_names, blocks)
    for keys in (first, second):
        assert keys.untyped_storage().data_ptr() == storage  # carved, not allocated
    assert second.data_ptr() >= first.data_ptr() + first.numel() * 4  # apart: no overlap
    assert torch.equal(second, torch.cat([blocks[n].keys for n in second_names], dim=2))
    assert torch.equal(second_values, torch.cat([blocks[n].values for n in second_names], dim=2))
    assert torch.equal(first, torch.cat([blocks[n].keys for n in first_names], dim=2))  # not overwritten by the second
    third, _ = groups.get((KVView("b0"), KVView("b3")), blocks)  # the reserve's rest is too small: a buffer of its own
    assert third.untyped_storage().data_ptr() != storage
    assert torch.equal(third, torch.cat([blocks[KVView("b0")].keys, blocks[KVView("b3")].keys], dim=2))


def test_release_drops_the_groups_and_the_reserve():
    blocks = _blocks(4, 4)
    groups = AssembledGroups(max_bytes=_bytes(8) * 2)
    groups.reserve(torch.float32, torch.device("cpu"))
    names = (KVView("b0"), KVView("b1"))
    groups.get(names, blocks)
    groups.release()
    assert len(groups) == 0 and groups._reserve is None and groups.num_bytes == 0
    keys, _ = groups.get(names, blocks)  # assembled again, from a buffer of its own
    assert torch.equal(keys, torch.cat([blocks[n].keys for n in names], dim=2))

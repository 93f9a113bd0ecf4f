"""BlockIndex: chained prefix blocks in the tiered store (docs/architecture.md)."""

from __future__ import annotations

import torch

from promptcache.cache_store import BlockIndex, BlockIndexConfig, StoreConfig, build_store, chain_root

LAYERS, HEADS, DIM = 2, 2, 4


def _index(store=None, **config) -> BlockIndex:
    store = store or build_store(StoreConfig())
    return BlockIndex(store, BlockIndexConfig(**{"block_size": 8, **config}), model_fingerprint="m",
                      tokenizer_fingerprint="t", bytes_per_token=LAYERS * HEADS * DIM * 2 * 4)


def _kv(token_ids):
    """Deterministic fake KV: token i's states encode (i, token id), so slices are recognisable."""
    n = len(token_ids)
    base = torch.arange(n, dtype=torch.float32)[None, None, :, None] * 1000
    ids = torch.tensor(token_ids, dtype=torch.float32)[None, None, :, None]
    keys = (base + ids).expand(LAYERS, HEADS, n, DIM).contiguous()
    return keys, -keys


def _insert(index: BlockIndex, root: str, token_ids, *, salt=None, stored_upto: int = 0) -> int:
    keys, values = _kv(token_ids)
    return index.insert(root, token_ids, list(range(len(token_ids))),
                        lambda a, b: (keys[:, :, a:b], values[:, :, a:b]), salt=salt, stored_upto=stored_upto)


def test_longest_chain_reused_and_last_block_sliced():
    index, root = _index(), chain_root([])
    tokens = list(range(100, 120))
    assert _insert(index, root, tokens) == 16  # two full blocks stored; the 4-token tail too
    match = index.match(root, tokens, list(range(20)), salt=None, max_tokens=19)
    assert match.num_tokens == 19 and [link.num_tokens for link in match.links] == [8, 8, 3]
    assert match.links[-1].is_whole is False and match.links[0].is_whole
    keys = torch.cat([link.block.keys for link in match.links], dim=2)
    assert torch.equal(keys, _kv(tokens)[0][:, :, :19])


def test_divergence_inside_a_block_reuses_the_common_prefix_only():
    index, root = _index(), chain_root([])
    first = list(range(100, 120))
    second = [*first[:13], 7, 7, 7, 7, 7]
    _insert(index, root, first)
    match = index.match(root, second, list(range(18)), salt=None, max_tokens=17)
    assert match.num_tokens == 13
    keys = torch.cat([link.block.keys for link in match.links], dim=2)
    assert torch.equal(keys, _kv(second)[0][:, :, :13])  # the shared tokens' KV: a token sees only earlier ones


def test_positions_parents_and_salts_separate_chains():
    index, root = _index(), chain_root([])
    tokens = list(range(100, 124))
    _insert(index, root, tokens, salt="a")
    assert index.match(root, tokens, list(range(24)), salt="b", max_tokens=23).num_tokens == 0
    assert index.match(root, tokens, list(range(24)), salt=None, max_tokens=23).num_tokens == 0
    assert index.match(root, tokens, list(range(1, 25)), salt="a", max_tokens=23).num_tokens == 0
    assert index.match(chain_root(["some-module"]), tokens, list(range(24)), salt="a", max_tokens=23).num_tokens == 0
    assert index.match(root, tokens, list(range(24)), salt="a", max_tokens=23).num_tokens == 23


def test_full_and_exact_tail_blocks_are_found_by_key_alone():
    """A second replica has no local map of partial blocks; keys alone find full blocks and the exact
    tail of a repeated prompt."""
    store = build_store(StoreConfig())
    root, tokens = chain_root([]), list(range(100, 121))
    _insert(_index(store), root, tokens)
    fresh = _index(store)
    assert fresh.match(root, tokens, list(range(21)), salt=None, max_tokens=20).num_tokens == 20
    assert fresh.match(root, [*tokens[:19], 5, 5], list(range(21)), salt=None, max_tokens=20).num_tokens == 16


def test_peek_reports_without_fetching_and_stored_upto_skips_stored_blocks():
    store = build_store(StoreConfig())
    index, root, tokens = _index(store), chain_root([]), list(range(100, 120))
    _insert(index, root, tokens)
    puts = store.stats().num_puts
    assert _insert(index, root, [*tokens, 1, 2, 3, 4, 5], stored_upto=16) == 24
    assert store.stats().num_puts - puts == 2  # only the new full block and the new tail
    gets = store.stats().num_gets
    assert sum(n for _, n in index.peek(root, tokens, list(range(20)), salt=None)) == 20
    assert store.stats().num_gets == gets


def test_partial_reuse_map_is_bounded():
    index, root = _index(max_children=3), chain_root([])
    for i in range(10):
        _insert(index, root, [i] * 5)  # ten different 5-token tails under one parent
    assert index._num_children <= 3

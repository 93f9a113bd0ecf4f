"""Reading part of a block (what a sliding window still reaches): the part equals the whole block's tokens from each
layer's first (chunk-aligned) token on, with zeros elsewhere, and verifies on its own — damage in a chunk read is
caught, damage elsewhere is not read; the Redis and disk tiers fetch only that part (counted bytes against the
file's size), signed or not; in-process tiers serve a part only to requests it covers, never write it back; a prefix
match that ends sooner than guessed widens its parts, and ends before a block that vanished meanwhile."""

from __future__ import annotations

import pytest
import torch

import promptcache.cache_store.block_format as block_format
from promptcache.cache_store import (
    BlobSigner,
    BlockIndex,
    BlockIndexConfig,
    BlockMismatchError,
    CorruptBlockError,
    DiskTier,
    KVBlock,
    LayerReach,
    MemoryTier,
    RedisTier,
    TieredStore,
    dumps,
    window_reach,
)
from promptcache.cache_store.block_format import read_part
from promptcache.cache_store.block_layout import HEADER_BYTES, Layout

KEY = "a" * 64
TOKENS = 300  # five chunks of 64, the last one short
REACH = LayerReach((0, 250, 300, 130))  # a full layer, two windows' tails, one layer reading nothing
REACH_OF_300 = LayerReach(REACH.first_tokens, TOKENS)  # the same, naming the block's length (a layout hint)


def block(tokens: int = TOKENS, dtype: torch.dtype = torch.float32) -> KVBlock:
    g = torch.Generator().manual_seed(tokens)
    keys, values = (torch.randn(4, 2, tokens, 8, generator=g).to(dtype) for _ in range(2))
    return KVBlock(keys, values, torch.arange(1000, 1000 + tokens))


def reader(blob: bytes, counted: list[int]):
    def read(ranges):
        pieces = [blob[a:b] for a, b in ranges]
        counted.append(sum(map(len, pieces)))
        return pieces
    return read


def assert_part_of(part: KVBlock, whole: KVBlock, reach: LayerReach, chunk: int = 64) -> None:
    """`part` holds `whole`'s tokens from each layer's first token (aligned down to `chunk`) on, zeros before it."""
    assert part.present is not None and part.serves(reach) and not part.serves(None)
    assert torch.equal(part.position_ids, whole.position_ids)
    for layer, first in enumerate(part.present.first_tokens):
        assert (first <= reach.first_tokens[layer] and first % chunk == 0) or first == whole.num_tokens
        assert first > reach.first_tokens[layer] - chunk
        for got, want in ((part.keys, whole.keys), (part.values, whole.values)):
            assert torch.equal(got[layer, :, first:], want[layer, :, first:])
            assert not got[layer, :, :first].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("secure", [False, True])
def test_a_part_read_fetches_and_checks_only_each_layers_tail(dtype, secure):
    whole = block(dtype=dtype)
    blob = dumps(whole, KEY, secure=secure)
    counted: list[int] = []
    part = read_part(reader(blob, counted), REACH, expect_key=KEY, secure=secure)
    assert part is not None
    assert_part_of(part, whole, REACH)
    assert part.present.first_tokens == (0, 192, 300, 128)
    layout = Layout.parse(blob)
    kv_row = 2 * 8 * whole.keys.element_size()  # bytes of one token of one layer: heads x head_dim
    read_kv = 2 * kv_row * sum(TOKENS - t for t in part.present.first_tokens)  # keys and values
    assert sum(counted) == HEADER_BYTES + (layout.head_bytes - HEADER_BYTES) \
        + layout.positions_bytes + read_kv
    assert sum(counted) < len(blob) * 0.55
    assert part.held_nbytes == whole.nbytes - 2 * kv_row * sum(part.present.first_tokens)
    whole_read = read_part(reader(blob, []), None, expect_key=KEY, secure=secure)
    assert whole_read is not None and whole_read.present is None and torch.equal(whole_read.keys, whole.keys)


def test_damage_is_caught_where_read_and_never_read_elsewhere():
    whole = block()
    blob = bytearray(dumps(whole, KEY))
    layout = Layout.parse(bytes(blob))
    (start, _), *_ = layout.ranges((0,) * 4)  # layer 0's keys, read by every reach
    damaged = bytearray(blob)
    damaged[start] ^= 1
    with pytest.raises(CorruptBlockError, match="checksum mismatch \\(keys of layer 0\\)"):
        read_part(reader(bytes(damaged), []), REACH, expect_key=KEY)
    unread = bytearray(blob)  # layer 2's first key: no reach of REACH's reads it
    unread[layout.span(0, 2, 0, 0, 1)[0]] ^= 1
    part = read_part(reader(bytes(unread), []), REACH, expect_key=KEY)
    assert part is not None
    assert_part_of(part, whole, REACH)
    with pytest.raises(CorruptBlockError, match="checksum"):
        block_format.loads(bytes(unread))  # read whole, it fails
    table = bytearray(blob)
    table[HEADER_BYTES] ^= 1
    with pytest.raises(CorruptBlockError, match="table"):
        read_part(reader(bytes(table), []), REACH, expect_key=KEY)
    with pytest.raises(BlockMismatchError, match="belongs to key"):
        read_part(reader(bytes(blob), []), REACH, expect_key="b" * 64)


def test_a_blob_of_an_older_version_is_left_to_a_whole_read():
    old = bytearray(dumps(block(), KEY))
    old[4:6] = (2).to_bytes(2, "little")
    assert read_part(reader(bytes(old), []), REACH, expect_key=KEY) is None


def test_window_reach_names_the_tail_each_local_layer_reads():
    positions = list(range(100, 300))
    # a query at 320 with windows 64 and 16 reads keys above 256 and 304: tokens 157.. and none
    assert window_reach((None, 64, 16), positions, 320) == LayerReach((0, 157, 200))
    assert window_reach((None, 64), positions, 320, shift=50) == LayerReach((0, 107))  # keys moved up by 50
    assert window_reach((None, None), positions, 320) is None
    assert window_reach((500,), positions, 320) is None  # the window reaches every key
    assert window_reach((64,), [5, 290, 10, 295], 320) == LayerReach((1,))  # not ascending: from the first in reach


@pytest.fixture(params=["redis", "disk"])
def shared(request, tmp_path):
    if request.param == "disk":
        return DiskTier(tmp_path / "disk", max_bytes=1 << 30)
    server = request.getfixturevalue("redis_server")
    return RedisTier(server.url, max_bytes=1 << 30, namespace="parts")


def test_shared_tiers_fetch_only_the_part(shared):
    whole = block()
    shared.put(KEY, whole, kind="module")
    before = shared.bytes_read
    hit = shared.lookup(KEY, REACH)
    assert hit is not None and hit.kind == "module"
    assert_part_of(hit.block, whole, REACH)
    part_bytes = shared.bytes_read - before
    full = shared.lookup(KEY)
    assert full is not None and full.block.present is None and torch.equal(full.block.values, whole.values)
    whole_bytes = shared.bytes_read - before - part_bytes
    assert part_bytes < 0.55 * whole_bytes
    assert shared.lookup("b" * 64, REACH) is None


def test_a_signed_redis_tier_reads_parts_and_refuses_a_forged_one(redis_server):
    signer = BlobSigner(b"k" * 32)
    tier = RedisTier(redis_server.url, max_bytes=1 << 30, namespace="signed", signer=signer)
    whole = block()
    tier.put(KEY, whole)
    hit = tier.lookup(KEY, REACH)
    assert hit is not None
    assert_part_of(hit.block, whole, REACH)
    forger = RedisTier(redis_server.url, max_bytes=1 << 30, namespace="signed")  # writes unsigned, no key
    forger.put(KEY, block(dtype=torch.float32))
    assert tier.lookup(KEY, REACH) is None  # the whole read it falls back to refuses and drops it
    assert not forger.contains(KEY)


def test_a_damaged_part_falls_back_to_the_whole_read_which_drops_it(tmp_path):
    disk = DiskTier(tmp_path, max_bytes=1 << 30)
    disk.put(KEY, block())
    path = tmp_path / f"{KEY}.kv"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # the last value of the last layer: every reach of REACH's reads it
    path.write_bytes(bytes(data))
    assert disk.lookup(KEY, REACH) is None
    assert not path.exists()


def test_in_process_tiers_serve_a_part_only_where_it_covers_and_never_write_it_back(tmp_path):
    disk = DiskTier(tmp_path, max_bytes=1 << 30)
    whole = block()
    nbytes = whole.nbytes
    store = TieredStore([MemoryTier("device", 2 * nbytes + 1), disk])
    disk.put(KEY, whole)
    got = store.get(KEY, reach=REACH)
    assert got is not None and got[1] == "disk"
    assert_part_of(got[0], whole, REACH)
    again = store.get(KEY, reach=LayerReach((0, 260, 300, 200)))  # less than the part holds: served from memory
    assert again is not None and again[1] == "device" and again[0] is store.tiers[0].get(KEY)
    more = store.get(KEY, reach=LayerReach((0, 10, 300, 130)))  # more: read again below, replacing the part
    assert more is not None and more[1] == "disk" and more[0].present == LayerReach((0, 0, 300, 128))
    whole_hit = store.get(KEY)
    assert whole_hit is not None and whole_hit[1] == "disk" and whole_hit[0].present is None
    store.get(KEY, reach=REACH)  # the whole block in memory serves any part; a part never replaces it
    assert store.tiers[0].get(KEY).present is None
    with pytest.raises(ValueError, match="read in part"):
        store.put("c" * 64, got[0])
    disk.delete(KEY)
    store.tiers[0].delete(KEY)
    disk.put(KEY, whole)
    store.get(KEY, reach=REACH)
    disk.delete(KEY)
    for i in range(3):  # evict the part: it is dropped, not demoted to the disk
        store.put(str(i) * 64, block())
    store.flush()
    assert not store.tiers[0].contains(KEY) and not disk.contains(KEY)


def test_a_part_moved_to_another_device_copies_only_what_it_holds():
    whole = block()
    part = whole.part(REACH)
    assert part.present == REACH and part.keys is whole.keys and whole.part(None) is whole
    moved = part.to("cpu:0")  # another device than the tensors' (no index): the copying path, as to a GPU
    assert moved is not part and moved.present == REACH
    assert_part_of(moved, whole, REACH, chunk=1)


def test_from_an_in_process_tier_below_only_the_part_moves_up_and_a_part_is_demoted_in_process_only(tmp_path):
    whole = block()
    device, host, disk = MemoryTier("device", 2 * whole.nbytes + 1), MemoryTier("host", 8 * whole.nbytes), \
        DiskTier(tmp_path, max_bytes=1 << 30)
    store = TieredStore([device, host, disk])
    host.put(KEY, whole)
    got = store.get(KEY, reach=REACH)
    assert got is not None and got[1] == "host"
    assert device.get(KEY).present == REACH and host.get(KEY).present is None
    assert store.get(KEY)[1] == "host"  # the whole block: the device's part does not serve it
    host.delete(KEY)
    device.delete(KEY)
    device.put(KEY, whole.part(REACH))
    for i in range(3):  # evicted from the device, the part goes to the host, never to the disk
        store.put(str(i) * 64, block())
    store.flush()
    assert host.get(KEY).present == REACH and not disk.contains(KEY)


def test_a_redis_part_read_takes_one_round_trip_when_it_knows_the_layout_and_two_when_its_guess_is_wrong(redis_server):
    reader, writer = (RedisTier(redis_server.url, max_bytes=1 << 30, namespace="guess") for _ in range(2))
    whole = block()
    reader.put(KEY, whole)  # the reader knows the layout of a 300-token block: this one's
    calls: list[int] = []
    read = reader._read

    def counted(queue):
        calls.append(1)
        return read(queue)

    reader._read = counted
    hit = reader.lookup(KEY, window_reach((None, 128, 64, 100), range(TOKENS), TOKENS))
    assert hit is not None and len(calls) == 1
    other = block(dtype=torch.bfloat16)  # the same length, another layout: the guess is wrong
    writer.put(KEY, other)
    calls.clear()
    hit = reader.lookup(KEY, REACH_OF_300)
    assert hit is not None and len(calls) == 2
    assert_part_of(hit.block, other, REACH_OF_300)


class VanishingStore(TieredStore):
    """A store whose `vanish` keys are deleted from every tier right after they are first read."""

    def __init__(self, tiers, vanish: set[str]) -> None:
        super().__init__(tiers)
        self.vanish = vanish

    def get(self, key, **kwargs):
        hit = super().get(key, **kwargs)
        if key in self.vanish:
            self.vanish.discard(key)
            self.delete(key)
        return hit


@pytest.mark.parametrize(("stored", "gone", "matched"), [(4, 3, 24), (1, 0, 0)])
def test_a_match_shorter_than_guessed_widens_its_parts_and_stops_where_a_block_is_gone(tmp_path, stored, gone,
                                                                                        matched):
    """Blocks of 8 tokens at positions 0.., windows of 8 on two of three layers; a request of `stored` x 8 + 8 tokens
    guesses its first query at its last token, but the chain ends after `stored` blocks. Block `gone` vanishes after
    its first (part) read: the match ends before it, and the parts left hold what the new first query reaches."""
    disk = DiskTier(tmp_path, max_bytes=1 << 30)
    g = torch.Generator().manual_seed(0)
    n = 8 * stored
    keys, values = (torch.randn(3, 1, n, 4, generator=g) for _ in range(2))
    ids, positions = list(range(100, 100 + n + 8)), list(range(n + 8))

    def index(store, windows=()):
        return BlockIndex(store, BlockIndexConfig(block_size=8), model_fingerprint="m", tokenizer_fingerprint="t",
                          bytes_per_token=96, windows=windows)

    writer = TieredStore([disk])
    index(writer).insert("root", ids[:n], positions[:n], lambda a, b: (keys[:, :, a:b], values[:, :, a:b]), salt=None)
    assert writer.flush(10)
    chain = [key for _, key, *_ in index(writer)._chain("root", ids, positions, None, n)]
    assert all(disk.contains(key) for key in chain)
    match = index(VanishingStore([disk], {chain[gone]}), (8, None, 8)).match("root", ids, positions, salt=None,
                                                                             max_tokens=n + 7)
    assert match.num_tokens == matched
    for link in match.links:  # each holds what a query at the match's end reaches: keys after it - 8
        reach = window_reach((8, None, 8), link.block.position_ids.tolist(), matched)
        assert link.block.serves(reach)
        for layer, first in enumerate((link.block.present or LayerReach((0, 0, 0))).first_tokens):
            assert torch.equal(link.block.keys[layer, :, first:], keys[layer, :, link.start + first: link.end])

"""The static (graph-capturable) step against the runner's eager pass, on the CPU: a tiny random-weight Llama (fp32,
layers fused with torch's ops as on a GPU) decodes B in {1, 3, 5} sequences padded to 4 and 8 and prefills 7 tokens
padded to 16 through StaticForward run eagerly; its logits, argmax and KV equal `ModelRunner.forward`'s, and its pad
rows write only the trash slots. On the meta device the same forward issues no host sync, and a layer issues at most
16 ops, attention one (the kernel's custom op on a GPU; here its reference op, counted as the one op it is). The
CUDA side (replay vs eager, capture without syncs, an engine with graphs on): test_cuda_graphs.py."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from promptcache.cache_store import KVBlock
from promptcache.model_runtime.attention.static_attention import reference_attention
from promptcache.model_runtime.engine.cuda_graphs import GraphedSteps, uniform_step
from promptcache.model_runtime.engine.prefix import KVView
from promptcache.model_runtime.engine.request import SeqStatus, Sequence, SharedKV
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.engine.step_buffers import TRASH_SLOTS, StepBuffers
from promptcache.model_runtime.engine.step_plan import ScheduledSeq
from promptcache.model_runtime.kv_pool import KVPool
from promptcache.model_runtime.loading import torch_layer_ops
from promptcache.model_runtime.loading.fused_layers import fuse_layers
from promptcache.model_runtime.loading.loader import wrap_model
from tests.model_factories import make_test_tokenizer, tiny_config

SHARED = 24  # tokens of the shared block every sequence sees


def _loaded(device: str = "cpu", dtype: torch.dtype = torch.float32):
    tokenizer = make_test_tokenizer()
    config = tiny_config("llama", vocab_size=len(tokenizer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert fuse_layers(model, torch_layer_ops) > 0  # the layers a GPU serves
    return wrap_model(model.to(device, dtype), tokenizer, name="tiny-llama-static")


def _sequences(loaded, num_seqs: int, *, num_new: int = 1, prefill: bool = False) -> list[Sequence]:
    """`num_seqs` sequences in one pool (gaps between their ranges) over one shared block, 3-5 own tokens each,
    `num_new` pending; a prefill's block is seen from its third new token on (a row offset)."""
    g, device, dtype = torch.Generator().manual_seed(1), loaded.model.device, loaded.model.dtype
    shape = (loaded.num_layers, loaded.num_kv_heads, SHARED, loaded.head_dim)
    keys, values = (torch.randn(shape, generator=g).to(device, dtype) for _ in range(2))
    block = KVBlock(keys, values, torch.arange(SHARED))
    pool = KVPool(num_layers=loaded.num_layers, num_kv_heads=loaded.num_kv_heads, head_dim=loaded.head_dim,
                  num_slots=1024, dtype=dtype, device=device)
    for kv in (pool.keys, pool.values):  # whatever a slot held before: a pad must leave it so
        kv.copy_(torch.randn(kv.shape, generator=g))
    seqs = []
    for i in range(num_seqs):
        own_length, capacity = 3 + i % 3, 16 + num_new
        seq = Sequence(seq_id=i, request=None, index=0,  # type: ignore[arg-type]
                       shared=[SharedKV(KVView("modules"), block, visible_from=2 if prefill else 0)])
        pool.allocate(5)  # a gap
        seq.own_pool, seq.own_slot = pool, pool.allocate(capacity)
        seq.own_keys, seq.own_values = pool.slots(seq.own_slot, capacity)
        seq.own_length = own_length
        seq.pending_ids = [(7 + 5 * i + t) % 60 + 3 for t in range(num_new)]
        seq.pending_positions = [SHARED + own_length + t for t in range(num_new)]
        seq.status = SeqStatus.PREFILL if prefill else SeqStatus.DECODE
        seqs.append(seq)
    return seqs


def _twins(seqs: list[Sequence]) -> list[Sequence]:
    """A deep copy of `seqs` with a pool of its own (the shared block's KV shared)."""
    pool = seqs[0].own_pool
    assert pool is not None
    twin_pool = copy.copy(pool)
    twin_pool._kv = (pool.keys.clone(), pool.values.clone())
    twin_pool._free, twin_pool._sizes = list(pool._free), dict(pool._sizes)
    twins = []
    for seq in seqs:
        twin = copy.copy(seq)
        twin.own_pool = twin_pool
        twin.own_keys, twin.own_values = twin_pool.slots(seq.own_slot, seq.own_keys.shape[2])  # type: ignore
        twin.pending_ids, twin.pending_positions = list(seq.pending_ids), list(seq.pending_positions)
        twins.append(twin)
    return twins


def _both(loaded, seqs: list[Sequence], max_num_seqs: int):
    """(eager logits, static output, eager pool, static pool, static pool before, the static runner's steps)."""
    twins = _twins(seqs)
    runner = ModelRunner(loaded)
    entries = [ScheduledSeq(s, len(s.pending_ids)) for s in seqs]
    expected, _ = runner.forward(entries)
    steps = GraphedSteps(loaded.model, backend="auto", max_num_seqs=max_num_seqs, use_graphs=False)
    pool = twins[0].own_pool
    assert pool is not None
    steps.trash_slot(pool)  # reserved before the snapshot
    before = (pool.keys.clone(), pool.values.clone())
    twin_entries = [ScheduledSeq(s, len(s.pending_ids)) for s in twins]
    with torch.inference_mode():
        got = steps.run(twin_entries, ModelRunner(loaded)._segments)
    assert got is not None, "a uniform step"
    return expected, got, seqs[0].own_pool, pool, before, steps


def _written_slots(seqs: list[Sequence]) -> list[int]:
    return [s.own_slot + s.own_length + t for s in seqs for t in range(len(s.pending_ids))]  # type: ignore


@pytest.mark.parametrize(("num_seqs", "max_num_seqs", "padded"), [(1, 4, 1), (3, 4, 4), (3, 8, 4), (5, 8, 8)])
def test_decode_equals_the_runner_and_pads_write_only_trash(num_seqs, max_num_seqs, padded):
    loaded = _loaded()
    seqs = _sequences(loaded, num_seqs)
    entries = [ScheduledSeq(s, 1) for s in seqs]
    step = uniform_step(entries, max_num_seqs)
    assert step is not None and step.num_seqs == padded
    expected, got, eager_pool, pool, before, steps = _both(loaded, seqs, max_num_seqs)
    assert got.logits.shape[0] == padded
    torch.testing.assert_close(got.logits[:num_seqs], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.greedy_ids[:num_seqs], expected.argmax(-1))
    _check_kv(seqs, eager_pool, pool, before, steps)


def test_lone_prefill_of_7_tokens_padded_to_16_equals_the_runner():
    loaded = _loaded()
    seqs = _sequences(loaded, 1, num_new=7, prefill=True)
    step = uniform_step([ScheduledSeq(seqs[0], 7)], 64)
    assert step is not None and (step.num_rows, step.num_seqs, step.max_query_len) == (16, 2, 16)
    expected, got, eager_pool, pool, before, steps = _both(loaded, seqs, 64)
    torch.testing.assert_close(got.logits[:1], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.greedy_ids[:1], expected.argmax(-1))
    _check_kv(seqs, eager_pool, pool, before, steps)


def _check_kv(seqs, eager_pool: KVPool, pool: KVPool, before, steps: GraphedSteps) -> None:
    """The real rows' KV equals the runner's; every slot but theirs and the trash range is as it was."""
    written = torch.tensor(_written_slots(seqs))
    trash = steps.trash_slot(pool)
    assert trash is not None
    for got, eager, old in zip((pool.keys, pool.values), (eager_pool.keys, eager_pool.values), before):
        torch.testing.assert_close(got[:, :, written], eager[:, :, written], rtol=1e-5, atol=1e-5)
        untouched = torch.ones(got.shape[2], dtype=torch.bool)
        untouched[written] = False
        untouched[trash: trash + TRASH_SLOTS] = False
        assert torch.equal(got[:, :, untouched], old[:, :, untouched])  # pads wrote no live sequence's KV
        assert not torch.equal(got[:, :, trash: trash + TRASH_SLOTS], old[:, :, trash: trash + TRASH_SLOTS]) or \
            len(written) == steps.buffers[next(iter(steps.buffers))].shape.num_rows  # pads wrote their trash


def test_mixed_steps_are_not_uniform():
    loaded = _loaded()
    decodes, prefill = _sequences(loaded, 2), _sequences(loaded, 1, num_new=3, prefill=True)
    assert uniform_step([ScheduledSeq(decodes[0], 1), ScheduledSeq(prefill[0], 3)], 8) is None
    assert uniform_step([ScheduledSeq(prefill[0], 3)], 8) is not None
    long = _sequences(loaded, 1, num_new=300, prefill=True)
    assert uniform_step([ScheduledSeq(long[0], 300)], 8) is None  # past the largest prefill bucket


class _NoHostSync(TorchDispatchMode):
    """Fails on any op that would make the host wait for the device: a scalar read (`.item()`, `.tolist()`, `int()`,
    `bool()` reach `_local_scalar_dense`), or a copy from a device to the CPU. Counts the rest (views excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        assert "_local_scalar_dense" not in name and name not in ("item", "tolist"), f"host sync: {name}"
        out = func(*args, **(kwargs or {}))
        if name.startswith(("_to_copy", "copy_")):
            sources = [a for a in args if isinstance(a, torch.Tensor)]
            assert not (isinstance(out, torch.Tensor) and out.device.type == "cpu"
                        and any(s.device.type != "cpu" for s in sources)), f"device-to-host copy: {name}"
        if not func.is_view:
            self.counts[name] += 1
        return out


def _meta_ops(num_layers: int, num_seqs: int) -> Counter[str]:
    """The ops of one static decode forward of `num_seqs` rows on the meta device (buffers filled on the host)."""
    tokenizer = make_test_tokenizer()
    config = tiny_config("llama", vocab_size=len(tokenizer))
    config.num_hidden_layers = num_layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    fuse_layers(model, torch_layer_ops)
    steps = GraphedSteps(model, backend="auto", max_num_seqs=64, use_graphs=False)
    shape = (num_layers, config.num_key_value_heads, 512, config.hidden_size // config.num_attention_heads)
    pool = KVPool(num_layers=shape[0], num_kv_heads=shape[1], head_dim=shape[3], num_slots=512,
                  dtype=torch.float32, device="meta")
    segment = torch.empty((*shape[:2], 40, shape[3]), device="meta")
    seqs = _meta_seqs(pool, num_seqs, segment)
    counter = _NoHostSync()
    with torch.inference_mode(), counter:
        out = steps.run([ScheduledSeq(s, 1) for s in seqs], lambda entries: [
            (segment, segment, tuple(range(len(entries))), None)])
    assert out is not None and out.logits.device.type == "meta"
    return counter.counts


def _meta_seqs(pool: KVPool, num_seqs: int, segment: torch.Tensor) -> list[Sequence]:
    seqs = []
    for i in range(num_seqs):
        seq = Sequence(seq_id=i, request=None, index=0, shared=[])  # type: ignore[arg-type]
        seq.own_pool, seq.own_slot, seq.own_length = pool, pool.allocate(8), 2 + i
        seq.pending_ids, seq.pending_positions, seq.status = [5], [40 + 2 + i], SeqStatus.DECODE
        seqs.append(seq)
    return seqs


def test_static_forward_on_meta_issues_no_host_sync_and_few_ops_per_layer():
    """One layer's ops = (ops of 4 layers - ops of 2) / 2. Attention is one op: `static_attention_reference` here,
    `shared_prefix_attention` on a GPU, both custom ops the mode sees once (their insides are not dispatched to it).
    Measured: 14 = 2 RMSNorms, the qkv and gate|up GEMMs, RoPE (mul, roll, addcmul), the two KV `index_copy_`s,
    attention, o_proj and down_proj each with its residual add as one addmm, SiLU and its product with up."""
    four, two = _meta_ops(4, 5), _meta_ops(2, 5)
    four.subtract(two)
    per_layer = Counter({name: count // 2 for name, count in four.items() if count})
    attention = sum(c for n, c in per_layer.items() if "attention" in n)
    assert attention == 1, per_layer
    assert per_layer["index_copy_.default"] == 2, per_layer
    assert sum(per_layer.values()) <= 16, per_layer


def test_reference_attention_on_meta_issues_no_host_sync():
    """The reference op's own body (run outside the op, so the mode sees each of its ops) on meta tensors."""
    q = torch.empty((6, 4, 16), device="meta")
    pool = torch.empty((2, 2, 64, 16), device="meta")
    seg = torch.empty((2, 2, 10, 16), device="meta")
    tables = [torch.empty(shape, dtype=torch.int32, device="meta") for shape in ((3, 4), (6, 2), (1, 3))]
    with _NoHostSync():
        out, lse = reference_attention(q, pool, pool, *tables, [seg], [seg], 1, 0.25)
    assert out.shape == (6, 4, 16) and lse.shape == (6, 4)


def test_buffers_are_views_of_one_tensor_rewritten_every_fill():
    """Every table is a view of one device tensor (one H2D copy a step); a fill with fewer sequences rewrites the
    entries the last one set (a pad never keeps a real sequence's stale row)."""
    loaded = _loaded()
    steps = GraphedSteps(loaded.model, backend="auto", max_num_seqs=8, use_graphs=False)
    seqs = _sequences(loaded, 4)
    with torch.inference_mode():
        steps.run([ScheduledSeq(s, 1) for s in seqs], lambda entries: [])
        [buffers] = steps.buffers.values()
        first = {name: view.clone() for name, view in buffers.views.items()}
        steps.run([ScheduledSeq(s, 1) for s in seqs[:3]], lambda entries: [])
    assert isinstance(buffers, StepBuffers) and len(steps.buffers) == 1  # 3 and 4 share the bucket of 4
    storages = {view.untyped_storage().data_ptr() for view in buffers.views.values()}
    assert len(storages) == 1
    trash = steps.trash_slot(seqs[0].own_pool)  # type: ignore[arg-type]
    assert int(buffers.views["write_slots"][3]) == trash  # the fourth row is a pad now
    assert int(first["write_slots"][3]) != trash
    assert buffers.views["seq_table"][3].tolist() == [3, 1, trash, 1]

"""KVPool and the pooled engine step: slot ranges as a brute-force slot set allots them; a step's own-KV
writes and decode reads a constant number of ops per layer whatever the number of sequences; the pooled
step equal, bit for bit, to the step over buffers of their own; every slot back once requests finish."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from promptcache.cache_store import KVBlock
from promptcache.model_runtime import SamplingParams
from promptcache.model_runtime.attention import dispatch
from promptcache.model_runtime.engine import Engine, EngineConfig
from promptcache.model_runtime.engine.prefix import KVView
from promptcache.model_runtime.engine.request import Sequence, SharedKV
from promptcache.model_runtime.engine.runner import ModelRunner
from promptcache.model_runtime.kv_pool import KVPool
from promptcache.model_runtime.loading.loader import wrap_model
from promptcache.model_runtime.packed_attention import BatchCache
from tests.conftest import TEST_DEVICE, make_tiny_runtime
from tests.model_factories import make_test_tokenizer, tiny_config
from tests.model_runtime.engine_probe import feed
from tests.model_runtime.oracles import reference_tokens
from tests.model_runtime.test_engine import SCHEMA, _collect, _prompts

SHARED, OWN = 40, 5  # decode steps over 40 shared tokens and 5-7 own ones (the padded own-KV call)


class _KernelOps(TorchDispatchMode):
    """Counts the aten ops that compute or copy (views excluded: they launch nothing on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.counts[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def _first_fit(used: set[int], num_slots: int, size: int) -> int | None:
    run = 0
    for slot in range(num_slots):
        run = 0 if slot in used else run + 1
        if run == size:
            return slot - size + 1
    return None


def test_allocations_match_a_first_fit_over_a_slot_set():
    rng = random.Random(5)
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=1, num_slots=64, dtype=torch.float32, device="meta")
    used: set[int] = set()
    held: dict[int, int] = {}
    for _ in range(2000):
        if held and rng.random() < 0.45:
            first = rng.choice(sorted(held))
            pool.free(first)
            used -= set(range(first, first + held.pop(first)))
        else:
            size = rng.randint(1, 20)
            first = pool.allocate(size)
            assert first == _first_fit(used, 64, size)
            if first is not None:
                used |= set(range(first, first + size))
                held[first] = size
        assert pool.num_free == 64 - len(used)
    for first in list(held):
        pool.free(first)
    assert pool.allocate(64) == 0  # freed ranges merged back into one


def _loaded(num_layers: int, device: str = TEST_DEVICE):
    tokenizer = make_test_tokenizer()
    config = tiny_config("llama", vocab_size=len(tokenizer))
    config.num_hidden_layers = num_layers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().to(device)
    return wrap_model(model, tokenizer, name=f"tiny-llama-{num_layers}")


def _sequences(loaded, num_seqs: int, pooled: set[int]) -> list[Sequence]:
    """`num_seqs` decoding sequences over one shared block; those in `pooled` own slots of one pool
    (every other one, its first slots apart), the others buffers of their own. Same KV either way."""
    g, device = torch.Generator().manual_seed(1), loaded.model.device
    shape = (loaded.num_layers, loaded.num_kv_heads, SHARED, loaded.head_dim)
    block = KVBlock(torch.randn(shape, generator=g).to(device), torch.randn(shape, generator=g).to(device),
                    torch.arange(SHARED))
    pool = KVPool(num_layers=loaded.num_layers, num_kv_heads=loaded.num_kv_heads, head_dim=loaded.head_dim,
                  num_slots=32 * num_seqs, dtype=torch.float32, device=device)
    seqs = []
    for i in range(num_seqs):
        own_length, capacity = OWN + i % 3, OWN + 4
        seq = Sequence(seq_id=i, request=None, index=0, shared=[SharedKV(KVView("modules"), block)])  # type: ignore[arg-type]
        if i in pooled:
            pool.allocate(16)  # a gap, so pooled sequences' slots are not one run
            seq.own_pool, seq.own_slot = pool, pool.allocate(capacity)
            seq.own_keys, seq.own_values = pool.slots(seq.own_slot, capacity)
        else:
            own_shape = (loaded.num_layers, loaded.num_kv_heads, capacity, loaded.head_dim)
            seq.own_keys, seq.own_values = torch.empty(own_shape, device=device), torch.empty(own_shape, device=device)
        for own in (seq.own_keys, seq.own_values):
            own[:, :, :own_length] = torch.randn(own[:, :, :own_length].shape, generator=g).to(device)
        seq.own_length = own_length
        seq.pending_ids, seq.pending_positions = [7 + i], [SHARED + own_length]
        seqs.append(seq)
    return seqs


def _update_ops(loaded, num_seqs: int, pooled: set[int], monkeypatch) -> list[Counter[str]]:
    """Ops of the own-KV update (BatchCache.update) of each layer in one decode step."""
    update, calls = BatchCache.update, []

    def counted(self, *args, **kwargs):
        with _KernelOps() as counter:
            result = update(self, *args, **kwargs)
        calls.append(counter.counts)
        return result

    monkeypatch.setattr(BatchCache, "update", counted)
    feed(ModelRunner(loaded), _sequences(loaded, num_seqs, pooled))
    monkeypatch.setattr(BatchCache, "update", update)
    return calls


def test_own_kv_update_is_one_index_copy_per_layer_whatever_the_batch(monkeypatch):
    loaded = _loaded(4)
    small, large = (_update_ops(loaded, n, set(range(n)), monkeypatch) for n in (2, 16))
    assert small == large  # the first layer also builds the step's slot index on the host, in as many ops
    assert large[1:] == [Counter({"index_copy_.default": 2})] * 3  # keys and values
    # The counter sees per-sequence copies: buffers of their own take one copy each.
    assert _update_ops(loaded, 16, set(), monkeypatch) == [Counter({"copy_.default": 32})] * 4


def _step_ops(loaded, num_seqs: int) -> Counter[str]:
    counter = _KernelOps()
    seqs = _sequences(loaded, num_seqs, set(range(num_seqs)))
    runner = ModelRunner(loaded)
    with torch.inference_mode(), counter:
        feed(runner, seqs)
    return counter.counts


@pytest.mark.parametrize("num_seqs", [4, 16])
@pytest.mark.parametrize("branch", ["device", "gpu_on_meta"])
def test_decode_step_ops_per_layer_do_not_grow_with_the_batch(num_seqs, branch, monkeypatch):
    """Per layer, a decode step issues as many ops for 2 sequences as for `num_seqs`: on the test device,
    and through the GPU kernels on the meta device (where a host sync inside a layer would raise)."""
    two, four = _loaded(2), _loaded(4)
    if branch == "gpu_on_meta":
        monkeypatch.setattr(dispatch, "GPU_DEVICE_TYPES", frozenset({"cuda", "meta"}))
        two.model.to("meta")
        four.model.to("meta")

    def per_layer(n: int) -> Counter[str]:  # ops of 2 more layers, halved: what one layer issues
        more = _step_ops(four, n)
        more.subtract(_step_ops(two, n))
        return Counter({name: count / 2 for name, count in more.items() if count})

    assert per_layer(num_seqs) == per_layer(2)


@pytest.mark.parametrize("pooled", [set(range(6)), {1, 2, 4}], ids=["all", "mixed"])
def test_pooled_step_equals_buffers_of_their_own(pooled):
    loaded = _loaded(2)
    apart, together = _sequences(loaded, 6, set()), _sequences(loaded, 6, pooled)
    expected, got = feed(ModelRunner(loaded), apart), feed(ModelRunner(loaded), together)
    assert torch.equal(got, expected)
    for old, new in zip(apart, together):
        assert new.own_length == old.own_length
        assert torch.equal(new.own_keys[:, :, :new.own_length], old.own_keys[:, :, :old.own_length])
        assert torch.equal(new.own_values[:, :, :new.own_length], old.own_values[:, :, :old.own_length])


def test_engine_gives_every_slot_back():
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    rng = random.Random(3)
    prompts = _prompts(rng, 6)
    params = [SamplingParams(max_tokens=rng.randint(2, 6), temperature=0, ignore_eos=True, n=2 if i % 2 else 1)
              for i in range(len(prompts))]
    expected = [reference_tokens(runtime.loaded, runtime.plan(p), sp) for p, sp in zip(prompts, params)]
    engine = Engine(runtime.module_encoder, EngineConfig(max_num_seqs=4))
    pool = engine.scheduler.own_kv.pool

    async def main():
        return await asyncio.gather(*(_collect(engine.submit(runtime.plan(p), sp)) for p, sp in zip(prompts, params)))

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    for result, want, sp in zip(results, expected, params):
        assert result["final"].report.error is None
        assert all(result["tokens"][i] == want for i in range(sp.n))
    assert pool.num_free == pool.shape[2]

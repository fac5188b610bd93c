"""MemoryStore: round trip, no-copy contract, LRU by access, pins, identity checks, a model-based check."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefuse.errors import ConfigError, StoreError
from cachefuse.store.base import ChunkKV, KVStore
from cachefuse.store.memory import MemoryStore
from tests.helpers.store import (
    CAPACITIES,
    IDENTITY,
    IDENTITY_BF16,
    NUM_LAYERS,
    OPS,
    assert_same_entry,
    entry_bytes,
    make_entry,
    run_ops,
)

# ---- tests ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 17])
def test_round_trip_is_bit_exact(dtype, num_tokens):
    identity = IDENTITY if dtype == torch.float32 else IDENTITY_BF16
    store = MemoryStore(identity, capacity_bytes=1 << 20)
    entry = make_entry(num_tokens, dtype, meta={"prefix": "a,b"})
    assert store.put("ab12", entry)
    got = store.get("ab12")
    assert_same_entry(got, entry)
    assert got.meta == {"prefix": "a,b"} and got.num_tokens == num_tokens and got.dtype == dtype
    assert store.contains("ab12") and not store.contains("ab13")
    assert store.nbytes == entry.nbytes == entry_bytes(num_tokens, dtype.itemsize)
    assert store.stats.hits == 1 and store.stats.puts == 1


def test_get_hands_out_the_stored_tensors_unchanged_by_callers_copies():
    store = MemoryStore(IDENTITY, capacity_bytes=1 << 20)
    entry = make_entry(7)
    snapshot = [t.clone() for t in (*entry.k_nope, *entry.v)]
    store.put("ab12", entry)
    got = store.get("ab12")
    assert got.k_nope[0] is entry.k_nope[0]  # no copy per hit: the contract is "never write into it"
    mine = got.k_nope[0].clone()
    mine.add_(1.0)
    again = store.get("ab12")
    for t, s in zip((*again.k_nope, *again.v), snapshot, strict=True):
        assert torch.equal(t, s)


def test_lru_evicts_least_recently_accessed():
    size = entry_bytes(5)
    store = MemoryStore(IDENTITY, capacity_bytes=3 * size)
    for i, key in enumerate(["aa01", "aa02", "aa03"]):
        assert store.put(key, make_entry(5, seed=i))
    assert store.get("aa01") is not None  # aa02 is now the least recently used
    assert store.put("aa04", make_entry(5, seed=4))
    assert store.keys() == ["aa03", "aa01", "aa04"]
    assert store.stats.evictions == 1 and store.nbytes == 3 * size


def test_pinned_entries_survive_and_pins_nest():
    store = MemoryStore(IDENTITY, capacity_bytes=2 * entry_bytes(5))
    store.put("aa01", make_entry(5, seed=1))
    store.pin("aa01")
    store.pin("aa01")
    store.unpin("aa01")  # still pinned once
    for i in range(2, 6):
        assert store.put(f"aa0{i}", make_entry(5, seed=i))
    assert store.contains("aa01")
    store.unpin("aa01")
    assert store.put("aa09", make_entry(5, seed=9))
    assert not store.contains("aa01")


def test_pinned_context_manager_and_full_of_pinned_entries():
    store = MemoryStore(IDENTITY, capacity_bytes=2 * entry_bytes(5))
    store.put("aa01", make_entry(5, seed=1))
    store.put("aa02", make_entry(5, seed=2))
    with store.pinned(["aa01", "aa02"]):
        assert not store.put("aa03", make_entry(5, seed=3))
        assert store.keys() == ["aa01", "aa02"]
    assert store.put("aa03", make_entry(5, seed=3))
    assert store.stats.put_failures == 1


def test_put_larger_than_capacity_fails_and_keeps_the_rest():
    store = MemoryStore(IDENTITY, capacity_bytes=entry_bytes(5))
    store.put("aa01", make_entry(5))
    assert not store.put("aa02", make_entry(6))
    assert store.keys() == ["aa01"] and store.stats.put_failures == 1


def test_replacing_a_key_keeps_the_byte_count():
    store = MemoryStore(IDENTITY, capacity_bytes=entry_bytes(9))
    store.put("aa01", make_entry(5))
    assert store.put("aa01", make_entry(9, seed=1))  # fits because the old entry is replaced
    assert store.nbytes == entry_bytes(9)
    assert_same_entry(store.get("aa01"), make_entry(9, seed=1))


@pytest.mark.parametrize(
    "entry",
    [make_entry(5, dtype=torch.bfloat16), make_entry(5, num_layers=NUM_LAYERS + 1), ChunkKV([], [])],
    ids=["dtype", "layers", "empty"],
)
def test_put_rejects_foreign_entries(entry):
    store = MemoryStore(IDENTITY, capacity_bytes=1 << 20)
    assert not store.put("aa01", entry)
    assert not store.contains("aa01") and store.stats.put_failures == 1


def test_miss_is_counted_as_absent_and_bad_keys_raise():
    store = MemoryStore(IDENTITY, capacity_bytes=1 << 20)
    assert store.get("aa01") is None
    assert store.stats.misses == {"absent": 1}
    with pytest.raises(StoreError):
        store.get("../etc")
    with pytest.raises(ConfigError):
        MemoryStore(IDENTITY, capacity_bytes=-1)
    assert isinstance(store, KVStore)


def test_get_layer_hands_out_one_stored_layer_counted_like_a_get():
    store = MemoryStore(IDENTITY, capacity_bytes=1 << 20)
    entry = make_entry(7)
    store.put("aa01", entry)
    store.put("aa02", make_entry(7, seed=2))
    k_nope, v = store.get_layer("aa01", 2)
    assert k_nope is entry.k_nope[2] and v is entry.v[2]  # no copy, as `get`
    assert store.stats.hits == 1 and store.stats.bytes_read == k_nope.nbytes + v.nbytes
    assert store.keys() == ["aa02", "aa01"]  # a layer read is a use
    assert store.get_layer("zz01", 0) is None and store.stats.misses == {"absent": 1}
    with pytest.raises(IndexError):
        store.get_layer("aa01", NUM_LAYERS)


def _out_of_device_memory(store: MemoryStore, monkeypatch) -> None:
    def place(tensor):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")  # as .to("cuda") raises

    monkeypatch.setattr(store, "_place", place)


def _page_lock_fails(store: MemoryStore, monkeypatch) -> None:
    def pin_memory(tensor, *args, **kwargs):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")  # as a failed pin_memory() raises

    store.pin_memory = True  # a pinned host tier (needs CUDA to construct; the pin itself is simulated)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)


@pytest.mark.parametrize("fail", [_out_of_device_memory, _page_lock_fails], ids=["cuda-oom", "pin-memory"])
def test_a_failed_placement_is_a_refused_put(monkeypatch, caplog, fail):
    """The KVStore contract: a put that cannot store returns False (logged once, counted); it never
    raises, so the tiers below still get the entry."""
    store = MemoryStore(IDENTITY, capacity_bytes=1 << 20)
    store.put("aa01", make_entry(5, seed=1))
    fail(store, monkeypatch)
    with caplog.at_level("WARNING", logger="cachefuse.store.memory"):
        assert not store.put("aa01", make_entry(5, seed=2))
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "aa01" in caplog.records[0].getMessage()
    assert store.stats.put_failures == 1 and store.stats.puts == 1
    assert_same_entry(store.get("aa01"), make_entry(5, seed=1))  # the previous entry is kept
    assert store.nbytes == entry_bytes(5)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, capacity=st.sampled_from(CAPACITIES))
def test_matches_reference_model(ops, capacity):
    run_ops(MemoryStore(IDENTITY, capacity), ops, size_of=lambda entry: entry.nbytes)

"""MemoryStore: round trip, no-copy contract, LRU by access, pins, identity checks, a model-based check.

Also hosts the helpers the other store tests import (entries, the reference LRU model).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefuse.errors import ConfigError, StoreError
from cachefuse.store.base import ChunkKV, KVStore, StoreIdentity
from cachefuse.store.memory import MemoryStore

NUM_LAYERS = 3
NUM_KV_HEADS = 2
HEAD_DIM = 8
HEAD_DIM_V = 6  # differs from HEAD_DIM on purpose (MLA-like models)
IDENTITY = StoreIdentity("fp-test", NUM_LAYERS, torch.float32)
IDENTITY_BF16 = StoreIdentity("fp-test", NUM_LAYERS, torch.bfloat16)


def make_entry(
    num_tokens: int = 5, dtype: torch.dtype = torch.float32, seed: int = 0, num_layers: int = NUM_LAYERS,
    meta: dict[str, str] | None = None,
) -> ChunkKV:
    """Random ChunkKV: per layer k_nope [num_tokens, NUM_KV_HEADS, HEAD_DIM], v [..., HEAD_DIM_V]."""
    gen = torch.Generator().manual_seed(seed)
    layers = range(num_layers)
    k_nope = [torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in layers]
    v = [torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM_V, generator=gen).to(dtype) for _ in layers]
    return ChunkKV(k_nope, v, dict(meta or {}))


def entry_bytes(num_tokens: int, element_size: int = 4) -> int:
    return NUM_LAYERS * num_tokens * NUM_KV_HEADS * (HEAD_DIM + HEAD_DIM_V) * element_size


def assert_same_entry(actual: ChunkKV | None, expected: ChunkKV) -> None:
    """Bit-exact equality of every tensor (dtype included) and of meta."""
    assert actual is not None
    assert actual.num_layers == expected.num_layers
    for a, e in zip((*actual.k_nope, *actual.v), (*expected.k_nope, *expected.v), strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert torch.equal(a, e)
    assert actual.meta == expected.meta


# ---- reference model for the hypothesis tests (memory and disk) ----

KEYS = ["aa01", "aa02", "bb03", "cc04", "cc05"]
ENTRY_POOL = [make_entry(num_tokens=n, seed=i, meta={"i": str(i)}) for i, n in enumerate([1, 2, 3, 5, 7, 17])]
# (op, key, index into ENTRY_POOL; read by "put" only); puts weighted up so that evictions are common.
OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "put", "get", "get", "pin", "unpin", "remove"]),
        st.sampled_from(KEYS),
        st.integers(0, len(ENTRY_POOL) - 1),
    ),
    min_size=5,
    max_size=50,
)
CAPACITIES = [0, 1000, 2500, 4000]  # entries are 336..2352 bytes (17 tokens: 5712, never fits)


def _model_put(order: OrderedDict, pins: Counter, capacity: int, key: str, size: int) -> list[str] | None:
    """Expected victims (LRU first, pinned skipped) of putting `key` of `size`, or None if it must fail."""
    others = {k: s for k, s in order.items() if k != key}
    if size + sum(s for k, s in others.items() if pins[k]) > capacity:
        return None
    used, victims = sum(others.values()), []
    for k, s in others.items():
        if used + size <= capacity:
            break
        if not pins[k]:
            victims.append(k)
            used -= s
    return victims


def run_ops(store: KVStore, ops: list[tuple[str, str, int]], size_of: Callable[[ChunkKV], int]) -> None:
    """Apply `ops` to `store` and to a reference LRU model; check they agree after every step."""
    order: OrderedDict[str, int] = OrderedDict()  # alive key -> stored bytes, least recently used first
    content: dict[str, ChunkKV] = {}
    pins: Counter = Counter()
    for op, key, index in ops:
        alive_before = set(order)
        if op == "put":
            entry = ENTRY_POOL[index]
            victims = _model_put(order, pins, store.capacity_bytes, key, size_of(entry))
            assert store.put(key, entry) == (victims is not None)
            if victims is not None:
                for victim in victims:
                    del order[victim]
                order.pop(key, None)
                order[key] = size_of(entry)
                content[key] = entry
        elif op == "get":
            got = store.get(key)
            if key in order:
                assert_same_entry(got, content[key])
                order.move_to_end(key)
            else:
                assert got is None
        elif op == "pin":
            store.pin(key)
            pins[key] += 1
        elif op == "unpin" and pins[key]:
            store.unpin(key)
            pins[key] -= 1
        elif op == "remove":
            store.remove(key)
            order.pop(key, None)
        assert store.keys() == list(order)
        assert store.nbytes == sum(order.values()) <= store.capacity_bytes
        for k in alive_before:
            if pins[k] and not (op == "remove" and k == key):
                assert store.contains(k), f"pinned {k} was evicted"


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


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, capacity=st.sampled_from(CAPACITIES))
def test_matches_reference_model(ops, capacity):
    run_ops(MemoryStore(IDENTITY, capacity), ops, size_of=lambda entry: entry.nbytes)

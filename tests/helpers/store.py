"""Shared helpers of the store tests: random entries, bit-exact comparison, and a reference LRU model
that the hypothesis tests run every store against."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable

import torch
from hypothesis import strategies as st

from cachefuse.store.base import ChunkKV, KVStore, StoreIdentity

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

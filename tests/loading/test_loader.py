"""Layer loaders: the pipeline returns the serial bytes, loads ahead of compute, stays bounded, fails at
the right layer and never leaks its thread. Assertions are about event ORDER and COUNTS, never time."""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

import pytest
import torch

from cachefuse.errors import StoreError
from cachefuse.loading.loader import (
    EventLog,
    LayerUnavailable,
    PipelinedLoader,
    SerialLoader,
    store_layer_fetcher,
)
from cachefuse.store.base import StoreIdentity
from cachefuse.store.disk import DiskStore
from cachefuse.store.memory import MemoryStore
from tests.helpers.store import make_entry
from tests.helpers.throttled import FakeClock, ThrottledStore, real_sleep

NUM_LAYERS = 6
BIG = 1 << 24
KEYS = ["aa01", "bb02", "cc03"]
LOAD_DELAY = 0.010  # ordering tests only: real seconds per layer read
COMPUTE_DELAY = 0.010
WAIT = 5.0  # generous bound on scheduling noise; a correct pipeline never comes close


def _identity(dtype: torch.dtype = torch.float32) -> StoreIdentity:
    return StoreIdentity("fp-test", NUM_LAYERS, dtype)


def _fill(store, dtype: torch.dtype = torch.float32) -> dict:
    entries = {key: make_entry(num_tokens=3 + 4 * i, dtype=dtype, seed=i, num_layers=NUM_LAYERS)
               for i, key in enumerate(KEYS)}
    for key, entry in entries.items():
        assert store.put(key, entry)
    return entries


def _corrupt_tensor(path: Path, name: str) -> None:
    """Flip one byte inside tensor `name` of a safetensors file (its checksum then mismatches)."""
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    start, _ = json.loads(data[8:8 + header_len])[name]["data_offsets"]
    data[8 + header_len + start] ^= 0xFF
    path.write_bytes(bytes(data))


def _assert_same_layer(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for key, (k_nope, v) in expected.items():
        a_k, a_v = actual[key]
        assert a_k.dtype == k_nope.dtype and a_v.dtype == v.dtype
        assert torch.equal(a_k, k_nope) and torch.equal(a_v, v)


# ---- bytes: pipelined == serial == stored ----

@pytest.mark.parametrize(("depth", "dtype"), [(1, torch.float32), (2, torch.bfloat16), (3, torch.float32),
                                              (NUM_LAYERS + 2, torch.float32)])
def test_pipelined_equals_serial_over_disk(tmp_path, depth, dtype):
    store = DiskStore(tmp_path, _identity(dtype), BIG)
    entries = _fill(store, dtype)
    serial = SerialLoader(store_layer_fetcher(store, KEYS), NUM_LAYERS)
    with PipelinedLoader(store_layer_fetcher(store, KEYS), NUM_LAYERS, depth) as pipelined:
        for layer in range(NUM_LAYERS):
            expected = serial.layer(layer)
            _assert_same_layer(pipelined.layer(layer), expected)
            stored = {key: (e.k_nope[layer], e.v[layer]) for key, e in entries.items()}
            _assert_same_layer(expected, stored)
    assert pipelined.peak_buffered <= depth
    assert store.stats.hits == 2 * NUM_LAYERS * len(KEYS)  # one get_layer per key, layer and loader


class _WholeEntries:
    """A store face with `get` and `stats` only (no `get_layer`), whatever the real tiers grow."""

    def __init__(self, inner) -> None:
        self.inner, self.stats = inner, inner.stats

    def get(self, key):
        return self.inner.get(key)


def test_fetcher_without_get_layer_reads_each_entry_once():
    inner = MemoryStore(_identity(), BIG)
    entries = _fill(inner)
    store = _WholeEntries(inner)
    with PipelinedLoader(store_layer_fetcher(store, KEYS), NUM_LAYERS, depth=2) as loader:
        for layer in range(NUM_LAYERS):
            _assert_same_layer(loader.layer(layer),
                               {key: (e.k_nope[layer], e.v[layer]) for key, e in entries.items()})
    assert store.stats.hits == len(KEYS)  # one get per key, sliced per layer


def test_fetcher_misses_raise_layer_unavailable(tmp_path):
    inner = MemoryStore(_identity(), BIG)
    _fill(inner)
    store = _WholeEntries(inner)
    with pytest.raises(LayerUnavailable) as info:
        store_layer_fetcher(store, [KEYS[0], "zz99"])(0)
    assert (info.value.key, info.value.layer, info.value.reason) == ("zz99", 0, "absent")
    assert isinstance(info.value, StoreError)
    disk = DiskStore(tmp_path, _identity(), BIG)
    with pytest.raises(LayerUnavailable, match="absent"):
        store_layer_fetcher(disk, ["zz99"])(2)


# ---- ordering: layer i+1 loads while layer i computes ----

def _consume(loader, events: EventLog, wait_timeout: float) -> None:
    """"Compute" each layer: sleep, then give the loader up to `wait_timeout` to start the next layer."""
    for i in range(NUM_LAYERS):
        loader.layer(i)
        events.record("compute_start", i)
        real_sleep(COMPUTE_DELAY)
        if i + 1 < NUM_LAYERS:
            events.wait_for("load_start", i + 1, timeout=wait_timeout)
        events.record("compute_end", i)


def _loads_during_compute(events: EventLog) -> list[bool]:
    return [events.index("load_start", i + 1) < events.index("compute_end", i) for i in range(NUM_LAYERS - 1)]


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_next_layer_loads_before_compute_ends(depth):
    inner = MemoryStore(_identity(), BIG)
    _fill(inner)
    store = ThrottledStore(inner, LOAD_DELAY, sleep=real_sleep)
    events = EventLog(clock=FakeClock())  # times are irrelevant: the log's order is the evidence
    with PipelinedLoader(store_layer_fetcher(store, KEYS), NUM_LAYERS, depth, events=events) as loader:
        _consume(loader, events, WAIT)
    assert all(_loads_during_compute(events))
    for i in range(NUM_LAYERS):
        assert events.index("load_end", i) < events.index("compute_start", i)
    assert 1 <= loader.peak_buffered <= depth + 1
    assert store.calls == [(key, layer) for layer in range(NUM_LAYERS) for key in KEYS]


def test_serial_loader_never_loads_during_compute():
    """The control: the same consumer over the serial loader sees every load after the compute before it."""
    inner = MemoryStore(_identity(), BIG)
    _fill(inner)
    store = ThrottledStore(inner, 0.0)
    events = EventLog(clock=FakeClock())
    _consume(SerialLoader(store_layer_fetcher(store, KEYS), NUM_LAYERS, events=events), events, 0.002)
    assert not any(_loads_during_compute(events))


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_buffer_fills_to_depth_and_blocks(depth):
    events = EventLog()
    with PipelinedLoader(lambda i: torch.full((2,), i), NUM_LAYERS, depth, events=events) as loader:
        assert events.wait_for("load_end", depth - 1, timeout=WAIT)
        assert not events.wait_for("load_start", depth, timeout=0.02)  # full: the worker waits for us
        assert loader.buffered == depth
        for i in range(NUM_LAYERS):
            assert torch.equal(loader.layer(i), torch.full((2,), i))
        assert loader.buffered == 0
    assert loader.peak_buffered == depth


# ---- errors and shutdown ----

@pytest.mark.parametrize("depth", [1, 3])
def test_corrupt_layer_surfaces_at_its_layer(tmp_path, depth):
    baseline = threading.active_count()
    store = DiskStore(tmp_path, _identity(), BIG)
    entries = _fill(store)
    _corrupt_tensor(tmp_path / KEYS[1][:2] / f"{KEYS[1]}.safetensors", "v.3")
    loader = PipelinedLoader(store_layer_fetcher(store, KEYS), NUM_LAYERS, depth)
    for layer in range(3):
        stored = {k: (e.k_nope[layer], e.v[layer]) for k, e in entries.items()}
        _assert_same_layer(loader.layer(layer), stored)
    with pytest.raises(LayerUnavailable) as info:
        loader.layer(3)
    assert (info.value.key, info.value.layer, info.value.reason) == (KEYS[1], 3, "corrupt")
    loader.close()
    assert not loader._thread.is_alive()
    assert threading.active_count() == baseline
    assert loader.events.index("load_start", 3) >= 0
    with pytest.raises(ValueError, match="no event"):
        loader.events.index("load_start", 4)  # the worker stopped at the failed layer


def test_worker_error_is_reraised_for_later_layers_too():
    def fetch(i: int) -> int:
        if i == 2:
            raise KeyError("boom")
        return i

    with PipelinedLoader(fetch, NUM_LAYERS, depth=2) as loader:
        assert [loader.layer(0), loader.layer(1)] == [0, 1]
        with pytest.raises(KeyError, match="boom"):
            loader.layer(2)
    serial = SerialLoader(fetch, NUM_LAYERS)
    assert serial.layer(1) == 1
    with pytest.raises(KeyError, match="boom"):
        serial.layer(2)


def test_close_stops_a_blocked_worker_and_is_idempotent():
    baseline = threading.active_count()
    loader = PipelinedLoader(lambda i: i, NUM_LAYERS, depth=2)
    assert loader.events.wait_for("load_end", 1, timeout=WAIT)  # buffer full, worker waiting
    assert threading.active_count() == baseline + 1
    assert loader.layer(0) == 0
    loader.close()
    loader.close()
    assert not loader._thread.is_alive()
    assert threading.active_count() == baseline
    with pytest.raises(RuntimeError, match="closed"):
        loader.layer(1)


def test_close_waits_for_the_fetch_in_flight():
    release = threading.Event()
    loader = PipelinedLoader(lambda i: release.wait(WAIT), NUM_LAYERS, depth=1)
    assert loader.events.wait_for("load_start", 0, timeout=WAIT)
    timer = threading.Timer(0.01, release.set)
    timer.start()
    loader.close()  # joins after the fetch returns; the worker then starts nothing new
    timer.join()
    assert not loader._thread.is_alive()
    assert [e[:2] for e in loader.events.events] == [("load_start", 0), ("load_end", 0)]


def test_misuse_is_rejected():
    with PipelinedLoader(lambda i: i, 3, depth=1) as loader:
        with pytest.raises(ValueError, match="out of order"):
            loader.layer(1)
        assert [loader.layer(i) for i in range(3)] == [0, 1, 2]
        with pytest.raises(ValueError, match="out of order"):
            loader.layer(0)
    with pytest.raises(ValueError, match="depth"):
        PipelinedLoader(lambda i: i, 3, depth=0)
    with pytest.raises(IndexError):
        SerialLoader(lambda i: i, 3).layer(3)
    with PipelinedLoader(lambda i: i, 0, depth=1) as empty:
        empty._thread.join(WAIT)
        assert not empty._thread.is_alive()

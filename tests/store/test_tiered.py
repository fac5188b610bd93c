"""TieredStore and open_store: write-through, promotion after a disk hit (and its failures), per-layer
reads, fan-out of pins, stats."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from cachefuse.errors import ConfigError
from cachefuse.loading.loader import PipelinedLoader, SerialLoader, store_layer_fetcher
from cachefuse.store.base import KVStore
from cachefuse.store.disk import DiskStore
from cachefuse.store.memory import MemoryStore
from cachefuse.store.tiered import TieredStore, open_store
from tests.helpers.store import (
    IDENTITY,
    IDENTITY_BF16,
    NUM_LAYERS,
    assert_same_entry,
    entry_bytes,
    make_entry,
)

KEY = "ab12cd"
BIG = 1 << 24


def entry_file(root: Path, key: str = KEY) -> Path:
    return root / key[:2] / f"{key}.safetensors"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_put_writes_through_and_round_trips(tmp_path, dtype):
    identity = IDENTITY if dtype == torch.float32 else IDENTITY_BF16
    store = open_store(tmp_path, identity, memory_capacity_bytes=BIG, disk_capacity_bytes=BIG)
    memory, disk = store.tiers
    assert isinstance(memory, MemoryStore) and isinstance(disk, DiskStore) and isinstance(store, KVStore)
    entry = make_entry(9, dtype, meta={"prefix": "x"})
    assert store.put(KEY, entry)
    assert memory.contains(KEY) and disk.contains(KEY) and entry_file(tmp_path).exists()
    assert_same_entry(store.get(KEY), entry)
    assert memory.stats.hits == 1 and disk.stats.hits == 0  # served from memory, disk untouched
    assert store.keys() == [KEY] and store.nbytes == memory.nbytes + disk.nbytes


def test_disk_hit_is_promoted_into_memory(tmp_path):
    entry = make_entry(7, meta={"variant": "base"})
    assert open_store(tmp_path, IDENTITY, BIG, BIG).put(KEY, entry)
    store = open_store(tmp_path, IDENTITY, BIG, BIG)  # a restart: memory is empty, disk has the entry
    memory, disk = store.tiers
    assert store.contains(KEY) and not memory.contains(KEY)
    assert_same_entry(store.get(KEY), entry)
    assert memory.contains(KEY) and disk.stats.hits == 1
    assert_same_entry(store.get(KEY), entry)
    assert memory.stats.hits == 1 and disk.stats.hits == 1  # the second get never reached the disk
    stats = store.stats
    assert stats.hits == 2 and stats.misses == {"absent": 1} and stats.puts == 1


def test_stored_bytes_are_identical_after_reads_and_caller_copies(tmp_path):
    store = open_store(tmp_path, IDENTITY, BIG, BIG)
    entry = make_entry(5)
    snapshot = [t.clone() for t in (*entry.k_nope, *entry.v)]
    store.put(KEY, entry)
    before = hashlib.sha256(entry_file(tmp_path).read_bytes()).hexdigest()
    got = store.get(KEY)
    work = [t.clone() for t in got.k_nope]  # what a fusor does before re-rotating
    for t in work:
        t.mul_(-1.0)
    assert hashlib.sha256(entry_file(tmp_path).read_bytes()).hexdigest() == before
    again = store.get(KEY)
    for t, s in zip((*again.k_nope, *again.v), snapshot, strict=True):
        assert torch.equal(t, s)


def test_put_succeeds_if_any_tier_takes_it(tmp_path):
    store = open_store(tmp_path, IDENTITY, memory_capacity_bytes=entry_bytes(3), disk_capacity_bytes=BIG)
    memory, disk = store.tiers
    assert store.put(KEY, make_entry(5))  # too big for memory, fine for disk
    assert not memory.contains(KEY) and disk.contains(KEY)
    assert_same_entry(store.get(KEY), make_entry(5))  # the failed promotion leaves the hit intact
    store.remove(KEY)
    assert not store.contains(KEY) and not entry_file(tmp_path).exists()


def _out_of_memory(tensor):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")  # as .to("cuda") raises


def test_a_faster_tier_out_of_memory_fails_neither_puts_nor_reads(tmp_path, monkeypatch):
    store = open_store(tmp_path, IDENTITY, BIG, BIG)
    memory, disk = store.tiers
    assert disk.put(KEY, make_entry(5, seed=1))
    monkeypatch.setattr(memory, "_place", _out_of_memory)
    assert_same_entry(store.get(KEY), make_entry(5, seed=1))  # the promotion is refused, the read served
    assert store.last_hit_tier == "disk" and not memory.contains(KEY)
    assert store.put("cd34ef", make_entry(5, seed=2))  # write-through reaches the disk tier
    assert disk.contains("cd34ef") and not memory.contains("cd34ef")
    assert memory.stats.put_failures == 2


class _RaisingTier(MemoryStore):
    """A tier breaking the contract: its put raises."""

    def put(self, key, entry):
        raise RuntimeError("broken tier")


def test_a_promotion_that_raises_never_fails_the_read(tmp_path):
    disk = DiskStore(tmp_path, IDENTITY, BIG)
    store = TieredStore([_RaisingTier(IDENTITY, BIG), MemoryStore(IDENTITY, BIG), disk])
    disk.put(KEY, make_entry(5))
    assert_same_entry(store.get(KEY), make_entry(5))
    assert store.last_hit_tier == "disk" and store.tiers[1].contains(KEY)  # the tiers after it are promoted into


def _disk_bytes_per_layer_fetch(store, disk: DiskStore, keys: list[str]) -> list[int]:
    fetch = store_layer_fetcher(store, keys)
    read = []
    for layer in range(NUM_LAYERS):
        before = disk.stats.bytes_read
        fetch(layer)
        read.append(disk.stats.bytes_read - before)
    return read


def test_the_layer_fetcher_reads_a_tiered_store_layer_by_layer(tmp_path):
    """open_store always returns a TieredStore: without its own `get_layer` the pipelined loader would
    read every whole entry at the first layer, and nothing would be pipelined."""
    disk = DiskStore(tmp_path, IDENTITY, BIG)
    keys = [f"c{i:04d}" for i in range(4)]
    for i, key in enumerate(keys):
        disk.put(key, make_entry(200, seed=i))
    per_layer = _disk_bytes_per_layer_fetch(disk, disk, keys)
    assert per_layer == [len(keys) * make_entry(200).nbytes // NUM_LAYERS] * NUM_LAYERS
    assert _disk_bytes_per_layer_fetch(TieredStore([MemoryStore(IDENTITY, 0), disk]), disk, keys) == per_layer


@pytest.mark.parametrize("depth", [1, 2])
def test_per_layer_reads_equal_whole_reads_from_every_tier(tmp_path, depth):
    disk = DiskStore(tmp_path, IDENTITY, BIG)
    store = TieredStore([MemoryStore(IDENTITY, BIG), disk])
    entries = {"mm01": make_entry(9, seed=1), "dd02": make_entry(13, seed=2), "bb03": make_entry(5, seed=3)}
    store.tiers[0].put("mm01", entries["mm01"])  # memory only
    disk.put("dd02", entries["dd02"])  # disk only
    store.put("bb03", entries["bb03"])  # both
    serial = SerialLoader(store_layer_fetcher(store, entries), NUM_LAYERS)
    with PipelinedLoader(store_layer_fetcher(store, entries), NUM_LAYERS, depth) as pipelined:
        for layer in range(NUM_LAYERS):
            for got in (serial.layer(layer), pipelined.layer(layer)):
                for key, (k_nope, v) in got.items():
                    whole = entries[key]
                    assert k_nope.dtype == whole.k_nope[layer].dtype and torch.equal(k_nope, whole.k_nope[layer])
                    assert v.dtype == whole.v[layer].dtype and torch.equal(v, whole.v[layer])
    assert pipelined.peak_buffered <= depth


def test_get_layer_names_the_serving_tier_and_promotes_after_the_last_layer(tmp_path):
    store = open_store(tmp_path, IDENTITY, BIG, BIG)
    memory, disk = store.tiers
    entry = make_entry(5, seed=1)
    disk.put(KEY, entry)
    memory.put("cd34ef", make_entry(5, seed=2))
    for layer in range(NUM_LAYERS):
        assert not memory.contains(KEY)  # promoted only once every layer has been read
        assert store.get_layer(KEY, layer) is not None and store.last_hit_tier == "disk"
        assert store.get_layer("cd34ef", layer) is not None and store.last_hit_tier == "memory"
    promoted = memory.get(KEY)  # made of the layers read, nothing read twice
    assert disk.stats.bytes_read == entry.nbytes and promoted.meta == disk.get_meta(KEY)
    assert all(torch.equal(a, b) for a, b in zip(promoted.k_nope + promoted.v, entry.k_nope + entry.v, strict=True))
    assert store.get_layer("ef5678", 0) is None and store.last_hit_tier is None
    assert store.stats.misses == {"absent": NUM_LAYERS + 1}  # memory's, for the key only on disk and the unknown one


def test_get_layer_promotes_nothing_but_a_whole_in_order_read(tmp_path):
    store = open_store(tmp_path, IDENTITY, BIG, BIG)
    memory, disk = store.tiers
    disk.put(KEY, make_entry(5, seed=1))
    assert NUM_LAYERS == 3
    for layers in ([1, 2], [0, 2], [0, 1]):  # no layer 0 first, a gap, a pass abandoned early
        for layer in layers:
            store.get_layer(KEY, layer)
        assert not memory.contains(KEY)
    for layer in range(NUM_LAYERS):  # a read that starts again at layer 0 and ends
        store.get_layer(KEY, layer)
    assert memory.contains(KEY)
    lazy = TieredStore([MemoryStore(IDENTITY, BIG), disk], promote_on_hit=False)  # placement decides instead
    for layer in range(NUM_LAYERS):
        lazy.get_layer(KEY, layer)
    assert not lazy.tiers[0].contains(KEY)


def test_get_layer_keeps_the_serving_tiers_miss_semantics(tmp_path):
    """A layer a tier fails to verify is its miss (counted with its reason, the entry dropped there), and
    the next tier that has the key serves it, as `get` does."""
    upper, lower = DiskStore(tmp_path / "upper", IDENTITY, BIG), DiskStore(tmp_path / "lower", IDENTITY, BIG)
    store = TieredStore([upper, lower])
    entry = make_entry(5)
    assert store.put(KEY, entry)
    path = entry_file(tmp_path / "upper")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # a byte of the last tensor in the file
    path.write_bytes(bytes(raw))
    for layer in range(NUM_LAYERS):
        k_nope, v = store.get_layer(KEY, layer)
        assert torch.equal(k_nope, entry.k_nope[layer]) and torch.equal(v, entry.v[layer])
    assert store.stats.misses == {"corrupt": 1} and not upper.contains(KEY) and lower.contains(KEY)
    with pytest.raises(IndexError):
        store.get_layer(KEY, NUM_LAYERS)


class _WholeEntriesTier(MemoryStore):
    """A tier with no per-layer reads of its own."""

    get_layer = property(lambda self: None)


def test_a_tier_without_per_layer_reads_serves_layers_of_its_whole_entry(tmp_path):
    store = TieredStore([_WholeEntriesTier(IDENTITY, BIG), DiskStore(tmp_path, IDENTITY, BIG)])
    entry = make_entry(5)
    store.tiers[0].put(KEY, entry)
    k_nope, v = store.get_layer(KEY, 1)
    assert k_nope is entry.k_nope[1] and v is entry.v[1] and store.last_hit_tier == "memory"


def test_pins_fan_out(tmp_path):
    store = open_store(tmp_path, IDENTITY, memory_capacity_bytes=2 * entry_bytes(5), disk_capacity_bytes=BIG)
    memory, _ = store.tiers
    store.put("aa01", make_entry(5, seed=1))
    with store.pinned(["aa01"]):
        store.put("aa02", make_entry(5, seed=2))
        store.put("aa03", make_entry(5, seed=3))
        assert memory.keys() == ["aa01", "aa03"]  # aa02 went instead of the pinned aa01
    store.put("aa04", make_entry(5, seed=4))
    assert memory.keys() == ["aa03", "aa04"]
    assert store.keys() == ["aa03", "aa04", "aa01", "aa02"]


def test_open_store_skips_tiers_with_zero_capacity(tmp_path):
    disk_only = open_store(tmp_path, IDENTITY, memory_capacity_bytes=0, disk_capacity_bytes=BIG)
    assert [type(t) for t in disk_only.tiers] == [DiskStore]
    memory_only = open_store(tmp_path / "unused", IDENTITY, memory_capacity_bytes=BIG, disk_capacity_bytes=0)
    assert [type(t) for t in memory_only.tiers] == [MemoryStore] and not (tmp_path / "unused").exists()
    none = open_store(tmp_path, IDENTITY, 0, 0)
    assert not none.put(KEY, make_entry(5)) and none.get(KEY) is None and none.capacity_bytes == 0
    with pytest.raises(ConfigError, match="disk_capacity_bytes"):
        open_store(tmp_path, IDENTITY, BIG, -1)


def test_tiers_can_be_composed_by_hand():
    store = TieredStore([MemoryStore(IDENTITY, BIG), MemoryStore(IDENTITY, BIG)])
    store.tiers[1].put(KEY, make_entry(3))
    assert_same_entry(store.get(KEY), make_entry(3))
    assert store.tiers[0].contains(KEY)


def test_device_tier_is_refused_for_a_model_on_the_cpu(tmp_path):
    with pytest.raises(ConfigError, match=r"device_capacity_bytes=1024 .* runs on cpu.*memory_capacity_bytes"):
        open_store(tmp_path, IDENTITY, BIG, BIG, device="cpu", device_capacity_bytes=1024)
    with pytest.raises(ConfigError, match="device_capacity_bytes"):
        open_store(tmp_path, IDENTITY, BIG, BIG, device_capacity_bytes=-1)
    store = open_store(tmp_path, IDENTITY, BIG, BIG, device="cpu", device_capacity_bytes=0)
    memory = store.tiers[0]
    assert [t.name for t in store.tiers] == ["memory", "disk"] and not memory.pin_memory  # pinning needs CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_tier_sits_above_a_pinned_host_tier_on_cuda(tmp_path):
    store = open_store(tmp_path, IDENTITY, BIG, BIG, device="cuda", device_capacity_bytes=BIG)
    assert [t.name for t in store.tiers] == ["device", "memory", "disk"] and store.tiers[1].pin_memory
    store.tiers[2].put(KEY, make_entry(3))  # on disk only
    entry = store.get(KEY)
    assert store.last_hit_tier == "disk" and entry is not None
    assert store.tiers[0].get(KEY).k_nope[0].is_cuda and store.tiers[1].get(KEY).k_nope[0].is_pinned()
    store.get(KEY)
    assert store.last_hit_tier == "device"

"""TieredStore and open_store: write-through, promotion after a disk hit, fan-out of pins, stats."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from cachefuse.errors import ConfigError
from cachefuse.store.base import KVStore
from cachefuse.store.disk import DiskStore
from cachefuse.store.memory import MemoryStore
from cachefuse.store.tiered import TieredStore, open_store
from tests.helpers.store import IDENTITY, IDENTITY_BF16, assert_same_entry, entry_bytes, make_entry

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

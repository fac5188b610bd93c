"""Several KVStore tiers behind one face, fastest first; and `open_store`, the embedded default.

Imports `cachefuse.store` modules only. A hit in a slower tier is promoted (put) into every faster
tier: at once for a `get`; for `get_layer` (the pipelined loader's reads) once layers 0..L-1 of the
entry have been read in order from that tier, from the layers read, so no byte is read twice; a put
writes through to every tier. Each tier keeps its own identity checks, capacity and eviction, so a tier may hold less
than the next one down. A promotion a faster tier refuses (or fails) leaves the read served.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from cachefuse.errors import ConfigError
from cachefuse.store.base import ChunkKV, KVStore, RowsKV, StoreIdentity, StoreStats, pinned_keys
from cachefuse.store.disk import DiskStore
from cachefuse.store.memory import MemoryStore

logger = logging.getLogger(__name__)
T = TypeVar("T")


class TieredStore:
    """Tiers fastest first (memory, then disk); itself a KVStore.

    Args:
        tiers: the tiers, fastest first; may be empty (then every get misses and every put fails).
        promote_on_hit: copy an entry into the faster tiers when a slower one serves it (the faster
            tiers then act as LRU caches); False leaves placement to a policy.
    """

    last_hit_tier: str | None = None

    MAX_ASSEMBLING = 256
    """Entries whose layers `get_layer` collects for a promotion at once; a read abandoned mid-entry (a
    pass that fails) leaves its layers here until newer reads push them out."""

    def __init__(self, tiers: list[KVStore], promote_on_hit: bool = True) -> None:
        self.tiers = list(tiers)
        self.promote_on_hit = promote_on_hit
        self._assembling: OrderedDict[str, _Assembly] = OrderedDict()
        self._assembling_lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        """Sum over tiers."""
        return sum(tier.capacity_bytes for tier in self.tiers)

    @property
    def nbytes(self) -> int:
        """Sum over tiers (an entry held by two tiers counts twice)."""
        return sum(tier.nbytes for tier in self.tiers)

    @property
    def stats(self) -> StoreStats:
        """Sum of the tiers' counters: a get served by the second tier counts a miss ("absent") in the
        first, a hit in the second and a put (the promotion) in the first. Per-tier figures are in
        `tiers[i].stats`."""
        total = StoreStats()
        for tier in self.tiers:
            total = total + tier.stats
        return total

    def get(self, key: str) -> ChunkKV | None:
        """The entry from the fastest tier that has it, promoted into the faster tiers; else None.

        `last_hit_tier` names the tier that served it (None on a miss), for measured load figures.
        """
        found = self._fastest(key, lambda tier: tier.get(key))
        if found is None:
            return None
        depth, entry = found
        if self.promote_on_hit:  # else a placement policy decides (cachefuse.loading.placement)
            self._promote(key, entry, self.tiers[:depth])
        return entry

    def get_layer(self, key: str, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One layer, (k_nope, v), from the fastest tier that has the key, read and verified by that tier's
        own `get_layer` (a tier without one: sliced from its `get`); a tier that misses is passed over as
        in `get`. None when every tier misses; `last_hit_tier` as in `get`.

        With `promote_on_hit`, the layers a slower tier serves are kept until the entry's last one has been
        read, layers 0..L-1 in order from the same tier (the pipelined loader's order); the entry they
        make is then promoted like a `get` hit: the faster tiers fill as they would under whole reads,
        without reading anything twice. Any other order of reads promotes nothing.
        """
        found = self._fastest(key, lambda tier: _read_layer(tier, key, layer))
        if found is None:
            return None
        depth, kv = found
        if self.promote_on_hit and depth > 0:
            entry = self._assemble(key, depth, layer, kv)
            if entry is not None:
                self._promote(key, entry, self.tiers[:depth])
        return kv

    def _assemble(self, key: str, depth: int, layer: int, kv: tuple[torch.Tensor, torch.Tensor]) -> ChunkKV | None:
        """Adds layer `layer` of `key`, served by tier `depth`, to its assembly; the whole entry once the
        last layer is in, else None."""
        tier = self.tiers[depth]
        num_layers = getattr(getattr(tier, "identity", None), "num_layers", None)
        if num_layers is None:
            return None
        with self._assembling_lock:
            assembly = self._assembling.pop(key, None)
            if layer == 0:
                assembly = _Assembly(depth, [], [])
            if assembly is None or assembly.depth != depth or len(assembly.k_nope) != layer:
                return None  # not a read of layers 0, 1, ... in order from one tier: nothing to promote
            assembly.k_nope.append(kv[0])
            assembly.v.append(kv[1])
            if len(assembly.k_nope) < num_layers:
                self._assembling[key] = assembly
                while len(self._assembling) > self.MAX_ASSEMBLING:
                    self._assembling.popitem(last=False)
                return None
        meta = tier.get_meta(key) if hasattr(tier, "get_meta") else None
        return None if meta is None else ChunkKV(assembly.k_nope, assembly.v, meta)

    def _fastest(self, key: str, read: Callable[[KVStore], T | None],
                 ask_fastest: bool = False) -> tuple[int, T] | None:
        """(depth, what `read(tier)` found) for the fastest tier where it found something; sets
        `last_hit_tier`. Tiers below the first are read only when they hold the key; the first too with
        `ask_fastest` (partial reads, which must not count a miss there)."""
        self.last_hit_tier = None
        for depth, tier in enumerate(self.tiers):
            if (depth > 0 or ask_fastest) and not tier.contains(key):
                continue  # skip the read and its "absent" count: the index already says no
            found = read(tier)
            if found is not None:
                self.last_hit_tier = getattr(tier, "name", type(tier).__name__)
                return depth, found
        return None

    def _promote(self, key: str, entry: ChunkKV, faster_tiers: list[KVStore]) -> None:
        """Put `entry` into `faster_tiers`; a tier that refuses it (full, out of device memory) keeps what
        it has, and one that breaks the put contract by raising still never fails the read."""
        for faster in faster_tiers:
            try:
                faster.put(key, entry)
            except Exception:  # noqa: BLE001 - the entry is already read: serving it matters more
                logger.warning("promoting %s into the %s tier failed; served from a slower tier", key,
                               getattr(faster, "name", type(faster).__name__), exc_info=True)

    def get_rows(self, key: str, layer: int, rows: torch.Tensor | None = None, values: bool = True) -> RowsKV | None:
        """Rows of one layer from the fastest tier that has the key (no promotion: a partial read)."""
        return self._first("get_rows", key, layer, rows, values)

    def get_meta(self, key: str) -> dict[str, str] | None:
        """The entry's metadata from the fastest tier that has the key."""
        return self._first("get_meta", key)

    def _first(self, method: str, key: str, *args):
        """`method(key, *args)` of the fastest tier that holds the key and has the method."""
        found = self._fastest(key, lambda tier: getattr(tier, method)(key, *args) if hasattr(tier, method) else None,
                              ask_fastest=True)
        return None if found is None else found[1]

    def put(self, key: str, entry: ChunkKV) -> bool:
        """Write through to every tier; True if at least one tier stored the entry."""
        stored = [tier.put(key, entry) for tier in self.tiers]
        return any(stored)

    def contains(self, key: str) -> bool:
        return any(tier.contains(key) for tier in self.tiers)

    def remove(self, key: str) -> None:
        for tier in self.tiers:
            tier.remove(key)

    def keys(self) -> list[str]:
        """Keys of every tier, fastest tier's first, without duplicates."""
        return list(dict.fromkeys(key for tier in self.tiers for key in tier.keys()))

    def pin(self, key: str) -> None:
        for tier in self.tiers:
            tier.pin(key)

    def unpin(self, key: str) -> None:
        for tier in self.tiers:
            tier.unpin(key)

    def pinned(self, keys: Iterable[str]) -> contextlib.AbstractContextManager:
        return pinned_keys(self, keys)


@dataclass
class _Assembly:
    """The layers of one entry read so far from tier `depth`, in order from layer 0."""

    depth: int
    k_nope: list[torch.Tensor]
    v: list[torch.Tensor]


def _read_layer(tier: KVStore, key: str, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One layer of `key` from `tier`: its own `get_layer`, else (a tier without per-layer reads) a slice
    of its whole entry."""
    get_layer = getattr(tier, "get_layer", None)
    if get_layer is not None:
        return get_layer(key, layer)
    entry = tier.get(key)
    return None if entry is None else (entry.k_nope[layer], entry.v[layer])


def open_store(
    root: str | Path, identity: StoreIdentity, memory_capacity_bytes: int, disk_capacity_bytes: int, *,
    redis_url: str | None = None, redis_timeout_s: float = 0.5, redis_capacity_bytes: int = 0,
    device: torch.device | str = "cpu", device_capacity_bytes: int = 0,
) -> TieredStore:
    """The embedded default: host memory over local disk, a tier skipped when its capacity is 0; with
    `redis_url`, a shared Redis tier below them (the faster tiers then cache what Redis holds); with
    `device_capacity_bytes`, a tier in the GPU's memory above them all.

    Args:
        root: directory of the disk tier.
        identity: what every entry must match.
        memory_capacity_bytes: tensor bytes the memory tier may hold; 0 disables it. Page-locked when
            `device` is a CUDA device (asynchronous copies to it).
        disk_capacity_bytes: file bytes the disk tier may hold; 0 disables it.
        redis_url: "redis://host:port/db" or "rediss://..."; None: no shared tier.
        redis_timeout_s: connect/read timeout of every Redis call (a slower answer is a miss).
        redis_capacity_bytes: byte budget of the Redis tier; 0: Redis's own maxmemory only.
        device: where the model runs.
        device_capacity_bytes: tensor bytes the device tier may hold on `device`; 0 disables it.

    Raises:
        ConfigError: a capacity is negative, or a device tier is asked for a model on the CPU.
    """
    capacities = {"device_capacity_bytes": device_capacity_bytes, "memory_capacity_bytes": memory_capacity_bytes,
                  "disk_capacity_bytes": disk_capacity_bytes}
    for name, value in capacities.items():
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name}={value!r}, expected an int >= 0 (0 disables the tier)")
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    if device_capacity_bytes > 0 and not on_gpu:
        raise ConfigError(
            f"device_capacity_bytes={device_capacity_bytes!r} but the model runs on {device.type}: a device tier "
            "holds chunks in a GPU's memory; set it to 0 and size memory_capacity_bytes instead")
    tiers: list[KVStore] = []
    if device_capacity_bytes > 0:
        tiers.append(MemoryStore(identity, device_capacity_bytes, device=device))
    if memory_capacity_bytes > 0:
        tiers.append(MemoryStore(identity, memory_capacity_bytes, pin_memory=on_gpu))
    if disk_capacity_bytes > 0:
        tiers.append(DiskStore(root, identity, disk_capacity_bytes))
    if redis_url is not None:
        from cachefuse.store.redis import RedisKVStore  # redis is imported only when configured

        tiers.append(RedisKVStore(redis_url, identity, redis_capacity_bytes, timeout_s=redis_timeout_s))
    if not tiers:
        logger.warning("store at %s has no tier (both capacities are 0): every chunk will be a miss", root)
    return TieredStore(tiers)

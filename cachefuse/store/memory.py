"""Memory tiers: ChunkKV objects in a dict, LRU by access, a byte capacity, pinned entries kept.

One class, two tiers: host memory (the default; `pin_memory=True` on a GPU machine keeps entries in
page-locked memory, so a load is one asynchronous DMA with no staging copy) and device memory
(`device="cuda"`: the hot-chunk tier, whose loads never cross PCIe), with the same LRU and pinning
rules.

Imports only `cachefuse.store.base` and `cachefuse.errors`. Follows the rules in base.py; in particular
`get` and `get_layer` hand out the stored tensors themselves (no copy): callers must never write into
them, and the caller of `put` hands its tensors over and must not write into them afterwards either.
That is what keeps stored caches byte-identical across requests without paying a copy per hit. (What
the disk tier hands over owns its memory: it is never a mapping of a file that could change later.)
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from cachefuse.errors import ConfigError
from cachefuse.store.base import (
    MISS_ABSENT,
    ChunkKV,
    EvictionPlanMixin,
    PinnedKeysMixin,
    PinTable,
    RowsKV,
    StoreIdentity,
    StoreStats,
    check_key,
    entry_mismatch,
    plan_eviction,
    select_rows,
)

logger = logging.getLogger(__name__)


class MemoryStore(PinnedKeysMixin, EvictionPlanMixin):
    """LRU memory tier (see module docstring for the no-copy contract).

    `name` ("memory", or "device" for a GPU's memory) labels the tier in measured load figures.

    Args:
        identity: what every entry must match; `put` rejects others.
        capacity_bytes: budget of tensor bytes (ChunkKV.nbytes summed over entries).
        device: where entries live: "cpu" (host memory) or a CUDA device (the device tier).
        pin_memory: host entries in page-locked memory (needs CUDA; ignored for a device tier).
    """

    name = "memory"

    def __init__(self, identity: StoreIdentity, capacity_bytes: int, device: torch.device | str = "cpu",
                 pin_memory: bool = False) -> None:
        if capacity_bytes < 0:
            raise ConfigError(f"memory capacity_bytes={capacity_bytes!r}, expected >= 0")
        self.device = torch.device(device)
        if self.device.type != "cpu":
            self.name = "device"
        self.pin_memory = pin_memory and self.device.type == "cpu"
        if self.pin_memory and not torch.cuda.is_available():
            raise ConfigError("memory pin_memory=True needs a CUDA device; leave it False on a CPU-only machine")
        self.identity = identity
        self.capacity_bytes = capacity_bytes
        self.stats = StoreStats()
        self._entries: dict[str, ChunkKV] = {}
        self._sizes: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._nbytes = 0
        self._pins = PinTable()
        self._lock = threading.RLock()

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def get(self, key: str) -> ChunkKV | None:
        """The stored entry itself (read-only by contract), or None on a miss."""
        return self._use(key, lambda entry: entry.nbytes)

    def get_layer(self, key: str, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One layer of the stored entry, (k_nope, v), the tensors themselves (read-only by contract); None
        on a miss. Counted like a `get` (one hit or miss per call), the bytes read being the layer's."""
        if not 0 <= layer < self.identity.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.identity.num_layers} layers")
        entry = self._use(key, lambda entry: entry.k_nope[layer].nbytes + entry.v[layer].nbytes)
        return None if entry is None else (entry.k_nope[layer], entry.v[layer])

    def _use(self, key: str, nbytes_read: Callable[[ChunkKV], int]) -> ChunkKV | None:
        """The entry of `key`, made most recently used and counted as a hit of `nbytes_read(entry)`
        bytes; None on a miss (counted)."""
        check_key(key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.stats.record_miss(MISS_ABSENT)
                logger.debug("memory miss %s: absent", key)
                return None
            self._sizes.move_to_end(key)
            self.stats.hits += 1
            self.stats.bytes_read += nbytes_read(entry)
            return entry

    def put(self, key: str, entry: ChunkKV) -> bool:
        """Store `entry` under `key`, evicting least recently used unpinned entries as needed.

        Returns:
            False (logged, counted) if the entry is foreign, cannot be placed where the tier keeps its
            entries (a CUDA out-of-memory, a failed page-lock), or does not fit even after evicting
            every unpinned entry; the previous entry of `key`, if any, is then kept.
        """
        check_key(key)
        mismatch = entry_mismatch(entry, self.identity)
        if mismatch is not None:
            return self._fail(key, "foreign entry ({}: {})".format(*mismatch))
        try:
            entry = self._placed(entry)
        except Exception as exc:  # noqa: BLE001 - out of device or page-locked memory is this tier's refusal
            return self._fail(key, f"cannot place it in {self._where()}: {exc!r}")
        nbytes = entry.nbytes
        with self._lock:
            victims = plan_eviction(self._sizes, self._pins, self.capacity_bytes, key, nbytes)
            if victims is None:
                return self._fail(key, f"{nbytes} bytes do not fit in {self.capacity_bytes} (rest pinned)")
            for victim in victims:
                self._drop(victim)
                self.stats.evictions += 1
                logger.debug("memory evicted %s", victim)
            self._drop(key)
            self._entries[key] = entry
            self._sizes[key] = nbytes
            self._nbytes += nbytes
            self.stats.puts += 1
            self.stats.bytes_written += nbytes
            return True

    def contains(self, key: str) -> bool:
        return key in self._entries

    def get_rows(self, key: str, layer: int, rows: torch.Tensor | None = None, values: bool = True) -> RowsKV | None:
        """Some rows of one layer (the question probe's reads before selection); counted as a `get`."""
        entry = self.get(key)
        if entry is None:
            return None
        return select_rows(entry.k_nope[layer], entry.v[layer], rows, values)

    def get_meta(self, key: str) -> dict[str, str] | None:
        """The entry's metadata alone; None on a miss (counted)."""
        entry = self.get(key)
        return None if entry is None else dict(entry.meta)

    def _placed(self, entry: ChunkKV) -> ChunkKV:
        # Tensors elsewhere are copied once here; tensors already where the tier keeps them are kept as given.
        return ChunkKV([self._place(t) for t in entry.k_nope], [self._place(t) for t in entry.v], dict(entry.meta))

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(self.device)
        return tensor.pin_memory() if self.pin_memory and not tensor.is_pinned() else tensor

    def _where(self) -> str:
        return "page-locked host memory" if self.pin_memory else str(self.device)

    def remove(self, key: str) -> None:
        """Drop `key` if present (pinned or not: pins only guard against eviction)."""
        with self._lock:
            self._drop(key)

    def keys(self) -> list[str]:
        """Stored keys, least recently used first."""
        with self._lock:
            return list(self._sizes)

    def _drop(self, key: str) -> None:
        if self._entries.pop(key, None) is not None:
            self._nbytes -= self._sizes.pop(key)

    def _fail(self, key: str, reason: str) -> bool:
        self.stats.put_failures += 1
        logger.warning("memory put %s failed: %s", key, reason)
        return False

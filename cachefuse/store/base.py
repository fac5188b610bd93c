"""The KV store contract: the stored unit (ChunkKV), the identity a store serves, the KVStore protocol.

Imports only torch and `cachefuse.errors`. Every tier (memory.py, disk.py, tiered.py, later redis.py)
follows the same rules (docs/architecture.md, "Packages and modules"):

- Stored caches are never mutated. A tier may hand out the tensors it holds; callers never write into
  them (clone first). A tier never writes into tensors it was given after `put` returns.
- A missing, corrupt or foreign entry is a miss (`get` returns None and the reason is counted in
  `StoreStats.misses`), never wrong KV and never an exception that escapes.
- `put` returns False when an entry cannot be stored (too big, everything else pinned, I/O error,
  foreign entry); it never raises for I/O.
- Pinned entries are never evicted; pins nest (a count per key) and may be taken before the entry exists.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from cachefuse.errors import StoreError

logger = logging.getLogger(__name__)

# Miss reasons, the keys of StoreStats.misses.
MISS_ABSENT = "absent"  # no such entry (never stored, evicted, removed, or its file vanished)
MISS_CORRUPT = "corrupt"  # unparsable file, missing tensor or checksum mismatch
MISS_TRUNCATED = "truncated"  # file shorter than its own header says
MISS_FOREIGN_MODEL = "foreign_model"  # written for another model fingerprint, dtype or format version
MISS_SHAPE_MISMATCH = "shape_mismatch"  # layer count or tensor shapes disagree with the identity/header
MISS_IO_ERROR = "io_error"  # the medium failed (permission, EIO, ...); the entry is kept
MISS_REASONS = (
    MISS_ABSENT, MISS_CORRUPT, MISS_TRUNCATED, MISS_FOREIGN_MODEL, MISS_SHAPE_MISMATCH, MISS_IO_ERROR,
)

MAX_ENTRY_HEADER_BYTES = 16 * 1024 * 1024
"""A stored entry's header past this is not one a tier wrote (dtypes, shapes, checksums and a chunk's meta:
kilobytes, under a megabyte for a 128K-token chunk's anchors). Parsed, a crafted one would take ~23x its
size in worker memory as Python objects; every tier refuses it as corrupt before parsing."""

# Keys become file names (disk) and Redis keys: a conservative alphabet, no path separators, and a
# first character that can never start a temp-file name (".tmp-").
_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{1,199}")


@dataclass
class ChunkKV:
    """One chunk's RoPE-stripped K and the V, per layer, as stored (storage dtype = model dtype).

    Attributes:
        k_nope: per layer, [num_tokens, num_kv_heads, head_dim], RoPE stripped.
        v: per layer, [num_tokens, num_kv_heads, head_dim_v].
        meta: free-form string metadata (e.g. the variant's prefix), stored with the entry.
    """

    k_nope: list[torch.Tensor]
    v: list[torch.Tensor]
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.k_nope)

    @property
    def num_tokens(self) -> int:
        return int(self.k_nope[0].shape[0]) if self.k_nope else 0

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data, K and V of every layer."""
        return sum(t.numel() * t.element_size() for t in (*self.k_nope, *self.v))

    @property
    def dtype(self) -> torch.dtype | None:
        return self.k_nope[0].dtype if self.k_nope else None


@dataclass(frozen=True)
class StoreIdentity:
    """What every entry of a store must match, else it is a foreign entry (a miss).

    Attributes:
        model_fingerprint: the checkpoint/config fingerprint that also enters every chunk key.
        num_layers: decoder layers of the model.
        dtype: storage dtype of K and V (the model's KV dtype).
    """

    model_fingerprint: str
    num_layers: int
    dtype: torch.dtype


@dataclass
class StoreStats:
    """Counters of one store (or the sum over tiers); plain ints, read without locking.

    Attributes:
        hits: `get`/`get_layer` calls that returned data.
        misses: reason (one of MISS_REASONS) -> count of calls that returned None.
        puts: entries stored.
        put_failures: `put` calls that returned False.
        evictions: entries dropped to make room (not explicit removes, not bad-data drops).
        bytes_read: tensor bytes handed out by hits.
        bytes_written: bytes stored by puts (tensor bytes in memory, file bytes on disk).
    """

    hits: int = 0
    misses: dict[str, int] = field(default_factory=dict)
    puts: int = 0
    put_failures: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    @property
    def num_misses(self) -> int:
        return sum(self.misses.values())

    def record_miss(self, reason: str) -> None:
        assert reason in MISS_REASONS, reason
        self.misses[reason] = self.misses.get(reason, 0) + 1

    def __add__(self, other: StoreStats) -> StoreStats:
        misses = dict(self.misses)
        for reason, count in other.misses.items():
            misses[reason] = misses.get(reason, 0) + count
        return StoreStats(
            hits=self.hits + other.hits,
            misses=misses,
            puts=self.puts + other.puts,
            put_failures=self.put_failures + other.put_failures,
            evictions=self.evictions + other.evictions,
            bytes_read=self.bytes_read + other.bytes_read,
            bytes_written=self.bytes_written + other.bytes_written,
        )


@runtime_checkable
class KVStore(Protocol):
    """One tier, or several behind one face (TieredStore). See the module docstring for the rules."""

    capacity_bytes: int
    stats: StoreStats

    @property
    def nbytes(self) -> int: ...

    def get(self, key: str) -> ChunkKV | None:
        """The entry, or None on a miss (reason counted and logged, never raised)."""
        ...

    def put(self, key: str, entry: ChunkKV) -> bool:
        """Store `entry` (replacing an entry of the same key); False if it cannot be stored."""
        ...

    def contains(self, key: str) -> bool:
        """Index lookup only, no I/O; a later `get` may still miss (eviction, corruption)."""
        ...

    def remove(self, key: str) -> None: ...

    def keys(self) -> list[str]: ...

    def pin(self, key: str) -> None: ...

    def unpin(self, key: str) -> None: ...

    def pinned(self, keys: Iterable[str]) -> contextlib.AbstractContextManager: ...


def is_valid_key(key: str) -> bool:
    """2-200 characters of [A-Za-z0-9_-], the first one alphanumeric."""
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None


def check_key(key: str) -> None:
    """Raise StoreError for a key no tier can hold (a caller bug, not a miss)."""
    if not is_valid_key(key):
        raise StoreError(f"store key {key!r}: expected 2-200 chars of [A-Za-z0-9_-], the first alphanumeric")


def entry_mismatch(entry: ChunkKV, identity: StoreIdentity) -> tuple[str, str] | None:
    """Why `entry` cannot belong to a store of `identity`, or None if it can.

    Returns:
        (miss reason, human-readable detail) or None.
    """
    if len(entry.k_nope) != identity.num_layers or len(entry.v) != identity.num_layers:
        return MISS_SHAPE_MISMATCH, (
            f"{len(entry.k_nope)} K / {len(entry.v)} V layers, expected {identity.num_layers}")
    num_tokens = entry.num_tokens
    for layer, (k_nope, v) in enumerate(zip(entry.k_nope, entry.v, strict=True)):
        if k_nope.dtype != identity.dtype or v.dtype != identity.dtype:
            return MISS_FOREIGN_MODEL, f"layer {layer}: {k_nope.dtype}/{v.dtype}, expected {identity.dtype}"
        # k_nope [num_tokens, num_kv_heads, head_dim], v [num_tokens, num_kv_heads, head_dim_v]
        three_dims = k_nope.dim() == 3 and v.dim() == 3
        if not three_dims or k_nope.shape[0] != num_tokens or v.shape[:2] != k_nope.shape[:2]:
            return MISS_SHAPE_MISMATCH, (
                f"layer {layer}: k_nope {tuple(k_nope.shape)}, v {tuple(v.shape)}, num_tokens {num_tokens}")
    if not all(isinstance(name, str) and isinstance(value, str) for name, value in entry.meta.items()):
        return MISS_CORRUPT, "meta must map str to str"
    return None


class PinTable:
    """Nested pin counts per key, shared by the tiers; thread-safe."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def pin(self, key: str) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        with self._lock:
            count = self._counts.get(key, 0)
            if count == 0:
                # NOTE: an unbalanced unpin is a caller bug, but raising here could fail a request
                # that otherwise succeeded; it is logged and ignored.
                logger.warning("unpin(%s): key is not pinned", key)
            elif count == 1:
                del self._counts[key]
            else:
                self._counts[key] = count - 1

    def __contains__(self, key: str) -> bool:
        return key in self._counts

    def count(self, key: str) -> int:
        return self._counts.get(key, 0)


@contextlib.contextmanager
def pinned_keys(store: KVStore, keys: Iterable[str]) -> Iterator[None]:
    """Pin `keys` in `store` for the duration of the block; unpins exactly what it pinned."""
    done: list[str] = []
    try:
        for key in keys:
            store.pin(key)
            done.append(key)
        yield
    finally:
        for key in reversed(done):
            store.unpin(key)


class PinnedKeysMixin:
    """pin / unpin / pinned for a store that keeps its pin counts in a PinTable at `self._pins`."""

    _pins: PinTable

    def pin(self, key: str) -> None:
        self._pins.pin(key)

    def unpin(self, key: str) -> None:
        self._pins.unpin(key)

    def pinned(self, keys: Iterable[str]) -> contextlib.AbstractContextManager:
        return pinned_keys(self, keys)


def plan_eviction(
    sizes: dict[str, int], pins: PinTable, capacity_bytes: int, key: str, nbytes: int
) -> list[str] | None:
    """Least recently used unpinned keys to evict so that `key` of `nbytes` fits, or None if it cannot.

    Args:
        sizes: key -> stored bytes, least recently used first (an OrderedDict in LRU order).
        pins: pinned keys are never chosen.
        capacity_bytes: the byte budget.
        key: the key being stored; its current entry (if any) is replaced, so it is not counted.
        nbytes: stored bytes of the new entry.

    Returns:
        Keys to evict, oldest first (possibly empty), or None when even evicting every unpinned entry
        leaves too little room.
    """
    used = sum(sizes.values()) - sizes.get(key, 0)
    victims: list[str] = []
    for other, size in sizes.items():
        if used + nbytes <= capacity_bytes:
            break
        if other != key and other not in pins:
            victims.append(other)
            used -= size
    return victims if used + nbytes <= capacity_bytes else None


class EvictionPlanMixin:
    """`size_of` and `plan_put` for a budgeted tier whose index is `self._sizes` (key -> stored bytes, least
    recently used first) under `self._lock`, with pins at `self._pins` and its budget `capacity_bytes`:
    what a placement policy asks before it reads an entry to promote."""

    _sizes: dict[str, int]
    _pins: PinTable
    _lock: Any
    capacity_bytes: int

    def size_of(self, key: str) -> int | None:
        """The stored bytes of `key` (as the budget counts them), or None when not indexed."""
        with self._lock:
            return self._sizes.get(key)

    def plan_put(self, key: str, nbytes: int) -> list[str] | None:
        """The keys a put of `nbytes` under `key` would evict now (plan_eviction), or None if it would not
        fit; nothing changes."""
        with self._lock:
            return plan_eviction(self._sizes, self._pins, self.capacity_bytes, key, nbytes)


RowsKV = tuple[torch.Tensor, torch.Tensor | None]
"""`get_rows`'s answer: (K rows, V rows or None when values were not asked for)."""


def select_rows(k_nope: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None, values: bool) -> RowsKV:
    """The rows (all when None) of one layer's K, and of its V when `values`: views or gathers, never the
    stored tensors written into."""
    if rows is not None:
        rows = rows.to(k_nope.device)
    k = k_nope if rows is None else k_nope[rows]
    if not values:
        return k, None
    return k, (v if rows is None else v[rows])


class LayerReadsMixin:
    """`get` and `get_layer` for a tier that verifies and reads a range of layers in `_load(key, layers)`
    (returning (k_nope per layer, v per layer, meta) or None after counting the miss)."""

    identity: StoreIdentity

    def _load(self, key: str, layers: range) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, str]] | None:
        raise NotImplementedError

    def get(self, key: str) -> ChunkKV | None:
        """Read and verify every layer of `key`; None on a miss (counted, logged, never raised)."""
        check_key(key)
        loaded = self._load(key, range(self.identity.num_layers))
        return None if loaded is None else ChunkKV(*loaded)

    def get_layer(self, key: str, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Read and verify one layer: (k_nope [num_tokens, num_kv_heads, head_dim], v [..., head_dim_v]).

        Counted in `stats` like a `get` (one hit or miss per call).
        """
        check_key(key)
        if not 0 <= layer < self.identity.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.identity.num_layers} layers")
        loaded = self._load(key, range(layer, layer + 1))
        return None if loaded is None else (loaded[0][0], loaded[1][0])

    def get_rows(self, key: str, layer: int, rows: torch.Tensor | None = None, values: bool = True) -> RowsKV | None:
        """Some rows of one layer (the question probe's reads before selection). The tier's checksums
        cover whole tensors, so the layer is read and verified whole and the rows handed out."""
        kv = self.get_layer(key, layer)
        return None if kv is None else select_rows(kv[0], kv[1], rows, values)

    def get_meta(self, key: str) -> dict[str, str] | None:
        """The entry's metadata alone (its header: no tensor is read); None on a miss."""
        check_key(key)
        loaded = self._load(key, range(0))
        return None if loaded is None else loaded[2]

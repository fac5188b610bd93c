"""Layer-wise KV loading, serial or pipelined: layer i+1 is fetched while layer i computes.

Imports threading, `cachefuse.store.base` and `cachefuse.torch_threads`; never vllm. Follows CacheBlend §5 and §6 ("two
threads ... pipeline prefill_layer of layer i and fetch_kv of layer i+1"): a `PipelinedLoader` runs
the per-layer fetch (and whatever the fetch does after reading, e.g. re-rotation) on one background
thread, layers 0..L-1 in order, into a bounded buffer, while the caller computes.

`LoadedLayers` is what the fusor reads: full-length views of every loaded chunk, one layer at a time,
gathered and re-rotated to target positions on the loader thread (or, for whole entries, on first use).

Memory: at most `depth` fetched-but-unconsumed layers exist at once (ready + in flight), plus the one
layer the caller is computing on, so the loader holds O(depth) layers, never O(L).

NOTE: on CPU a read from the page cache is itself CPU work (memcpy, checksum, header parsing) and
competes with compute for the same cores (and the GIL where the work is Python); real overlap exists
for I/O waits (a cold disk, the network) and on GPU, where the copy and re-rotation run on a separate
stream. The pipeline never changes the bytes: each layer is the same fetch, only earlier. The loader
thread runs torch on one thread (`cachefuse.torch_threads`: a second OpenMP team would slow every
parallel region of the thread that computes).

    time ->   | load 0 | load 1 | load 2 |  ...
                       | compute 0 | compute 1 | compute 2 |
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Generic, TypeVar

from torch import Tensor

from cachefuse.errors import StoreError
from cachefuse.store.base import MISS_SHAPE_MISMATCH, ChunkKV, KVStore
from cachefuse.torch_threads import start_helper_thread

if TYPE_CHECKING:  # the annotation only: the fusor imports this module
    pass

logger = logging.getLogger(__name__)

LayerKV = dict[str, tuple[Tensor, Tensor]]  # chunk key -> (k_nope, v) of one layer
FetchLayer = Callable[[int], LayerKV]  # layer -> that layer's K/V of every chunk
T = TypeVar("T")


class LayerUnavailable(StoreError):
    """One layer of one chunk could not be read (a miss mid-request: the request must fall back).

    Attributes:
        key: the chunk key.
        layer: the layer that missed.
        reason: a miss reason (one of `cachefuse.store.base.MISS_REASONS`) or "miss" when unknown.
    """

    def __init__(self, key: str, layer: int, reason: str) -> None:
        super().__init__(f"chunk {key} layer {layer}: {reason}")
        self.key, self.layer, self.reason = key, layer, reason


def read_or_unavailable(store: KVStore, key: str, layer: int, read: Callable[[], T | None]) -> T:
    """`read()` (one read of `key` from `store`), or LayerUnavailable at `layer` with the miss reason
    whose counter the read grew (best effort: counters are shared)."""
    before = dict(store.stats.misses)
    found = read()
    if found is None:
        after = store.stats.misses
        grown = [reason for reason, count in after.items() if count > before.get(reason, 0)]
        raise LayerUnavailable(key, layer, grown[0] if grown else "miss")
    return found


def store_layer_fetcher(store: KVStore, keys: Iterable[str]) -> FetchLayer:
    """A FetchLayer over `keys` of `store`: one `store.get_layer` per key and layer where the store has it.

    A store without `get_layer` is read with one `store.get(key)` per key on first use; the entry is
    kept and sliced per layer, and dropped after its last layer is handed out. The returned tensors
    may be the store's own (MemoryStore): callers must not write into them.

    Raises (from the returned function):
        LayerUnavailable: a key missed at that layer (absent, corrupt, evicted meanwhile, too few layers).
    """
    keys = list(keys)
    get_layer = getattr(store, "get_layer", None)
    if get_layer is not None:
        def fetch(layer: int) -> LayerKV:
            out: LayerKV = {}
            for key in keys:
                out[key] = read_or_unavailable(store, key, layer, lambda key=key: get_layer(key, layer))
            return out
        return fetch

    entries: dict[str, ChunkKV] = {}
    lock = threading.Lock()  # the serial and the pipelined caller may both hold this fetcher

    def fetch_sliced(layer: int) -> LayerKV:
        out: LayerKV = {}
        with lock:
            for key in keys:
                entry = entries.get(key)
                if entry is None:
                    entry = entries[key] = read_or_unavailable(store, key, layer, lambda key=key: store.get(key))
                if not 0 <= layer < entry.num_layers:
                    raise LayerUnavailable(key, layer, MISS_SHAPE_MISMATCH)
                out[key] = (entry.k_nope[layer], entry.v[layer])
                if layer == entry.num_layers - 1:
                    del entries[key]  # the last layer: keep memory O(1) entries per request, not O(L)
        return out
    return fetch_sliced


class EventLog:
    """A thread-safe, append-only list of (name, layer, time) with an injectable clock.

    The position in the log is the happens-before order (appends are serialized), so tests compare
    positions, never times.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._events: list[tuple[str, int, float]] = []
        self._cond = threading.Condition()

    def record(self, name: str, layer: int) -> None:
        with self._cond:
            self._events.append((name, layer, self.clock()))
            self._cond.notify_all()

    @property
    def events(self) -> list[tuple[str, int, float]]:
        with self._cond:
            return list(self._events)

    def index(self, name: str, layer: int) -> int:
        """Position of the first (name, layer) event; ValueError if there is none."""
        with self._cond:
            for position, (event, event_layer, _) in enumerate(self._events):
                if event == name and event_layer == layer:
                    return position
        raise ValueError(f"no event ({name!r}, {layer})")

    def wait_for(self, name: str, layer: int, timeout: float | None = None) -> bool:
        """Block until (name, layer) is recorded; False if `timeout` seconds pass first."""
        with self._cond:
            return self._cond.wait_for(
                lambda: any(e == name and lay == layer for e, lay, _ in self._events), timeout)


def _check_layer_count(num_layers: int) -> None:
    if num_layers < 0:
        raise ValueError(f"num_layers={num_layers!r}, expected >= 0")


class SerialLoader(Generic[T]):
    """Fetches each layer on demand in the caller's thread (the reference the pipeline must equal).

    Args:
        fetch: layer -> that layer's data (a FetchLayer, or one composed with re-rotation).
        num_layers: layers 0..num_layers-1 exist.
        events: where to record ("load_start", i) / ("load_end", i); a new EventLog(clock) if None.
    """

    def __init__(self, fetch: Callable[[int], T], num_layers: int, *, events: EventLog | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        _check_layer_count(num_layers)
        self.fetch, self.num_layers = fetch, num_layers
        self.events = events if events is not None else EventLog(clock)
        self.peak_buffered = 0

    def layer(self, i: int) -> T:
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} out of range for {self.num_layers} layers")
        self.peak_buffered = 1
        self.events.record("load_start", i)
        data = self.fetch(i)
        self.events.record("load_end", i)
        return data

    def close(self) -> None:
        pass

    def __enter__(self) -> SerialLoader[T]:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class PipelinedLoader(Generic[T]):
    """Fetches layers 0..L-1 in order on one daemon thread, at most `depth` layers ahead of the caller.

    The worker starts a fetch only while fewer than `depth` layers are ready or in flight, so
    `peak_buffered <= depth`. `layer(i)`, called for i = 0, 1, ... in order, blocks until layer i is
    ready and frees its slot. An exception raised by the fetch of layer j stops the worker and is
    re-raised (the same object) by `layer(j)` and any later call; layers before j are still served.
    `close()` (or leaving the `with` block) stops and joins the worker; always close a loader.

    Args:
        fetch: layer -> that layer's data; runs on the worker thread.
        num_layers: layers 0..num_layers-1 are fetched.
        depth: ready + in-flight layers allowed at once (>= 1; see `cachefuse.loading.controller.preload_depth`).
        events: where to record ("load_start", i) / ("load_end", i); a new EventLog(clock) if None.
    """

    def __init__(self, fetch: Callable[[int], T], num_layers: int, depth: int, *,
                 events: EventLog | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        _check_layer_count(num_layers)
        if depth < 1:
            raise ValueError(f"depth={depth!r}, expected >= 1")
        self.fetch, self.num_layers, self.depth = fetch, num_layers, depth
        self.events = events if events is not None else EventLog(clock)
        self.peak_buffered = 0
        self._ready: dict[int, T] = {}
        self._in_flight = 0  # 0 or 1: one worker
        self._error: tuple[int, BaseException] | None = None
        self._next = 0  # the layer the caller asks for next
        self._closed = False
        self._cond = threading.Condition()
        self._thread = start_helper_thread(self._run, "cachefuse-loader")

    @property
    def buffered(self) -> int:
        """Layers ready or in flight now."""
        with self._cond:
            return len(self._ready) + self._in_flight

    def _run(self) -> None:
        for i in range(self.num_layers):
            with self._cond:
                self._cond.wait_for(lambda: self._closed or len(self._ready) + self._in_flight < self.depth)
                if self._closed:
                    return
                self._in_flight = 1
                self.peak_buffered = max(self.peak_buffered, len(self._ready) + 1)
            self.events.record("load_start", i)
            try:
                data = self.fetch(i)
            except BaseException as exc:  # handed to the caller at layer i, whatever it is
                with self._cond:
                    self._error, self._in_flight = (i, exc), 0
                    self._cond.notify_all()
                return
            self.events.record("load_end", i)
            with self._cond:
                self._ready[i], self._in_flight = data, 0
                self._cond.notify_all()

    def layer(self, i: int) -> T:
        """Layer i's data, blocking until the worker has it; re-raises the worker's error at its layer."""
        if i != self._next:
            raise ValueError(f"layer({i}) out of order: layers are consumed 0, 1, ...; expected {self._next}")
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} out of range for {self.num_layers} layers")
        with self._cond:
            self._cond.wait_for(lambda: self._closed or i in self._ready
                                or (self._error is not None and self._error[0] <= i))
            if i in self._ready:
                self._next = i + 1
                data = self._ready.pop(i)
                self._cond.notify_all()  # a slot is free
                return data
            if self._error is not None:
                raise self._error[1]
            raise RuntimeError(f"layer({i}) on a closed loader")

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker (after its current fetch, if any) and join it; idempotent."""
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("loader thread still in a fetch after %.3g s; it exits when the fetch returns",
                           timeout)

    def __enter__(self) -> PipelinedLoader[T]:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

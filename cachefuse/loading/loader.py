"""Layer-wise KV loading, serial or pipelined: layer i+1 is fetched while layer i computes.

Imports torch, threading, `cachefuse.ops` and `cachefuse.store.base`; never vllm. Follows CacheBlend §5 and §6 ("two
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
stream. The pipeline never changes the bytes: each layer is the same fetch, only earlier.

    time ->   | load 0 | load 1 | load 2 |  ...
                       | compute 0 | compute 1 | compute 2 |
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import torch
from torch import Tensor

from cachefuse import ops
from cachefuse.errors import StoreError
from cachefuse.store.base import MISS_SHAPE_MISMATCH, ChunkKV, KVStore

if TYPE_CHECKING:  # the annotation only: the fusor imports this module
    from cachefuse.fusor import FuseRequest

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
        self._thread = threading.Thread(target=self._run, name="cachefuse-loader", daemon=True)
        self._thread.start()

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


@dataclass
class _Layer:
    """One layer of every loaded segment, rows in segment order ([num_loaded, num_kv_heads, head_dim])."""

    k_nope: torch.Tensor
    v: torch.Tensor
    k: torch.Tensor | None
    """k_nope rotated at its target positions; None until a layer that merges needs it."""
    ready: torch.cuda.Event | None = None
    """On a GPU: recorded on the loader's copy stream after the layer's copies and rotation; the pass's
    stream waits on it before the first read (None: on the CPU, nothing to wait for)."""


class LoadedLayers:
    """Full-length views of the loaded chunks, one layer at a time: `advance(layer)` for layers 0, 1, ...

    Whole entries (`request.loaded`) are sliced on first use in the pass's thread. Fetched chunks
    (`request.fetched`) come through a PipelinedLoader (preload_depth >= 1) whose worker thread also
    gathers and re-rotates, so layer i+1 is read and rotated while layer i computes, or a SerialLoader.
    Use it as a context manager: leaving the block joins the loader thread, also on an exception.
    """

    def __init__(self, request: FuseRequest, num_tokens: int, shape, rope_spec,
                 first_merged_layer: int, check_layers: set[int] | frozenset[int] = frozenset(),
                 device: torch.device | str = "cpu") -> None:
        self.num_tokens, self.shape, self.rope_spec = num_tokens, shape, rope_spec
        self.device = torch.device(device)
        # On a GPU, host-to-device copies and re-rotation run on a side stream (the loader thread's),
        # so layer i+1 travels while layer i computes on the pass's stream.
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # The pass's stream, read once: the pass runs on the stream current where it starts, and asking
        # torch.cuda.current_stream every layer costs host time on a launch-bound pass
        self.pass_stream = torch.cuda.current_stream(self.device) if self.copy_stream is not None else None
        self.first_merged_layer = first_merged_layer  # layers before it compute every row: no rotation
        # A full layer that is no check layer never reads loaded K/V (CacheBlend's layer 0): not fetched.
        self.unread_layers = set(range(first_merged_layer)) - set(check_layers)
        indices = sorted({*request.loaded, *request.fetched})
        self.sources = [(request.segments[i], request.loaded.get(i), request.fetched.get(i)) for i in indices]
        # Rows of every loaded segment, in segment order: one rotation and one scatter per layer.
        self.loaded_rows = (torch.cat([torch.arange(s.start, s.end, device=self.device) for s, _, _ in self.sources])
                            if self.sources else torch.zeros(0, dtype=torch.int64, device=self.device))
        # When the loaded segments are one run of positions (no hole between them, the common case), their
        # rows are a slice: a copy into it is cheaper than a scatter, on the GPU and in host time.
        spans = [(s.start, s.end) for s, _, _ in self.sources]
        contiguous = bool(spans) and all(end == start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
        self.loaded_slice = slice(spans[0][0], spans[-1][1]) if contiguous else None
        self.fetch = request.fetch_layer if request.fetched else None
        self.loader: SerialLoader | PipelinedLoader | None = None
        if self.fetch is not None:
            depth = request.preload_depth
            self.loader = (PipelinedLoader(self._work, shape.num_layers, depth) if depth >= 1
                           else SerialLoader(self._work, shape.num_layers))
        self._layer, self._current = -1, None

    def __enter__(self) -> LoadedLayers:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.loader is not None:
            self.loader.close()

    def advance(self, layer: int) -> None:
        """Make `layer` current (layers in order); re-raises loader.LayerUnavailable at its layer."""
        self._layer = layer
        self._current = self.loader.layer(layer) if self.loader is not None else None

    @torch.inference_mode()
    def _work(self, layer: int) -> _Layer:
        """Gather (and from the first merged layer on, re-rotate) one layer; the loader thread's work."""
        if not self.sources or layer in self.unread_layers:
            empty = torch.zeros((0, self.shape.num_kv_heads, self.shape.head_dim), dtype=self.shape.dtype,
                                device=self.device)
            return _Layer(empty, empty, empty)
        if self.copy_stream is None:
            return self._gather(layer)
        with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
            data = self._gather(layer)
            data.ready = self.copy_stream.record_event()
        return data

    def _gather(self, layer: int) -> _Layer:
        fetched: LayerKV = self.fetch(layer) if self.fetch is not None else {}
        parts = []
        for seg, entry, key in self.sources:
            k_nope, v = (entry.k_nope[layer], entry.v[layer]) if entry is not None else fetched[key]
            if k_nope.shape[0] != seg.length or v.shape[0] != seg.length:
                raise LayerUnavailable(key, layer, "length_mismatch")
            parts.append((k_nope, v))
        k_nope = self._stage([k for k, _ in parts])  # [num_loaded, num_kv_heads, head_dim] on the device
        v = self._stage([v for _, v in parts])
        # On a CPU the loader thread rotates ahead (overlapping the pass); on a GPU `rotated()` gathers
        # and rotates in one kernel straight into the merged K (no rotated copy to write and re-read).
        rotate_here = layer >= self.first_merged_layer and self.device.type != "cuda"
        k = self._rotate(k_nope) if rotate_here else None
        return _Layer(k_nope, v, k)

    def _stage(self, parts: list[Tensor]) -> Tensor:
        """The parts concatenated on the model's device. Host parts are copied straight into their slice of
        one device buffer: from page-locked memory (the host tier's `pin_memory`) each copy is an
        asynchronous DMA on the copy stream, with no host-side concatenation (a host memcpy of every
        loaded byte, measured slower than PCIe itself); entries of the device tier are concatenated
        where they are."""
        if self.device.type != "cuda" or all(t.device == self.device for t in parts):
            return torch.cat(parts).to(self.device)
        out = torch.empty((sum(t.shape[0] for t in parts), *parts[0].shape[1:]), dtype=parts[0].dtype,
                          device=self.device)
        offset = 0
        for part in parts:
            out[offset:offset + part.shape[0]].copy_(part, non_blocking=True)
            offset += part.shape[0]
        return out

    def _rotate(self, k_nope: torch.Tensor) -> torch.Tensor:
        return ops.apply_rope(k_nope, self.loaded_rows, self.rope_spec)

    def _data(self, layer: int) -> _Layer:
        if layer != self._layer:
            raise RuntimeError(f"layer {layer} asked for while layer {self._layer} is current")
        if self._current is None:
            self._current = self._work(layer)  # whole entries: gathered here, on first use
        if self._current.ready is not None:  # the copy stream's work for this layer, before any read
            stream = self.pass_stream
            stream.wait_event(self._current.ready)
            for tensor in (self._current.k_nope, self._current.v, self._current.k):
                if tensor is not None:  # allocated on the copy stream, read on this one
                    tensor.record_stream(stream)
            self._current.ready = None
        return self._current

    def stripped(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, num_kv_heads, head_dim] K (RoPE stripped) and V, zeros where nothing is loaded."""
        data = self._data(layer)
        shape = (self.num_tokens, self.shape.num_kv_heads, self.shape.head_dim)
        k_nope = torch.zeros(shape, dtype=self.shape.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.shape.dtype, device=self.device)
        self._scatter(k_nope, data.k_nope)
        self._scatter(v, data.v)
        return k_nope, v

    def rotated(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Loaded K re-rotated at its target positions, and V; both new tensors.

        Rows outside loaded segments are left uninitialised: they are forced rows, which the
        caller overwrites with freshly computed K/V before anything reads them.
        """
        data = self._data(layer)
        shape = (self.num_tokens, self.shape.num_kv_heads, self.shape.head_dim)
        k = torch.empty(shape, dtype=self.shape.dtype, device=self.device)
        v = torch.empty(shape, dtype=self.shape.dtype, device=self.device)
        if data.k is not None:  # rotated on the loader thread
            self._scatter(k, data.k)
        else:  # gathered and rotated in one pass, no rotated copy in between
            ops.gather_rotate(data.k_nope, k, self.loaded_rows, self.loaded_rows, self.rope_spec)
        self._scatter(v, data.v)
        return k, v

    def _scatter(self, full: torch.Tensor, loaded: torch.Tensor) -> None:
        """Writes the loaded segments' rows (`loaded`, in segment order) into the full-length `full`."""
        if self.loaded_slice is not None:
            full[self.loaded_slice].copy_(loaded)
        else:
            full[self.loaded_rows] = loaded

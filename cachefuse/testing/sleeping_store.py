"""SleepingStore: a KVStore wrapper whose reads sleep in proportion to the bytes they return.

Imports only the standard library, torch and `cachefuse.store.base`. Used by benchmarks/controller.py
to put chunks on a tier of a chosen bandwidth: `get` and `get_layer` read from the wrapped store, then
sleep `bytes / bytes_per_s`; everything else (put, contains, pins, stats, ...) is delegated.

NOTE: it models a slow tier whose reads are I/O waits (a cold disk, the network): the sleep releases
the CPU and the GIL, so a pipelined loader thread really overlaps it with compute. A read served from
the OS page cache is CPU work instead (memcpy, checksums) and competes with compute for the same
cores; this double says nothing about that case.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from cachefuse.store.base import ChunkKV, KVStore


class SleepingStore:
    """Wraps `inner`; each hit of `get` / `get_layer` sleeps `bytes / bytes_per_s` after reading.

    `name` ("sleeping") labels the tier in measured load figures (FusionStats.load_seconds_by_tier).
    A store without `get_layer` (a custom tier) is sliced from a `get`, so both look like a per-layer
    tier; only the returned layer's bytes are charged.

    Args:
        inner: the store holding the entries (a MemoryStore makes the sleep the whole cost of a read).
        bytes_per_s: modelled read bandwidth, > 0.
        sleep: injectable for tests; `time.sleep` by default.
    """

    name = "sleeping"

    def __init__(self, inner: KVStore, bytes_per_s: float,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s={bytes_per_s!r} must be > 0")
        self.inner, self.bytes_per_s, self.sleep = inner, float(bytes_per_s), sleep
        self.slept_s = 0.0
        """Seconds of sleep requested so far (all threads)."""
        self._lock = threading.Lock()

    def _charge(self, num_bytes: int) -> None:
        seconds = num_bytes / self.bytes_per_s
        with self._lock:
            self.slept_s += seconds
        self.sleep(seconds)

    def get(self, key: str) -> ChunkKV | None:
        entry = self.inner.get(key)
        if entry is not None:
            self._charge(entry.nbytes)
        return entry

    def get_layer(self, key: str, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        inner_get_layer = getattr(self.inner, "get_layer", None)
        if inner_get_layer is not None:
            kv = inner_get_layer(key, layer)
        else:
            entry = self.inner.get(key)
            kv = None if entry is None else (entry.k_nope[layer], entry.v[layer])
        if kv is not None:
            self._charge(kv[0].nbytes + kv[1].nbytes)
        return kv

    def __getattr__(self, name: str):
        if name == "inner":  # not yet set (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

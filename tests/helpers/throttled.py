"""Test doubles for the loader tests: a store whose per-layer reads take time, and a fake clock.

`ThrottledStore.get_layer` sleeps on an injectable `sleep` (a FakeClock's by default, so no real time
passes); the ordering tests pass `time.sleep` with delays of a few milliseconds and assert only the
order of recorded events, never durations.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from cachefuse.store.base import KVStore


class FakeClock:
    """A monotonic clock that moves only when told: `clock()` reads it, `sleep(dt)` advances it."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0, seconds
        with self._lock:
            self._now += seconds


class ThrottledStore:
    """Wraps a real store; `get_layer` sleeps `delay` first and records (key, layer) in `calls`.

    Delegates everything else to the wrapped store. For a store without `get_layer` (a custom tier) it
    slices a `get`, so both kinds look like a per-layer tier.
    """

    def __init__(self, inner: KVStore, delay: float, sleep: Callable[[float], None] | None = None) -> None:
        self.inner, self.delay = inner, delay
        self.sleep = sleep if sleep is not None else FakeClock().sleep
        self.calls: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def get_layer(self, key: str, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        with self._lock:
            self.calls.append((key, layer))
        self.sleep(self.delay)
        inner_get_layer = getattr(self.inner, "get_layer", None)
        if inner_get_layer is not None:
            return inner_get_layer(key, layer)
        entry = self.inner.get(key)
        return None if entry is None else (entry.k_nope[layer], entry.v[layer])

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def real_sleep(seconds: float) -> None:
    """time.sleep, named so that the tests that spend real time are easy to find."""
    time.sleep(seconds)

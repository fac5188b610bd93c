"""Hole saves written behind the request: `BackgroundSaver` and `PendingReadsStore`.

Imports torch, cachefuse.{errors, fusion.saving, metadata.base, store.base, torch_threads}; never vllm. A write costs a
device-to-host copy, a serialisation, an fsync and a metadata transaction (a Redis round trip when
shared). `BackgroundSaver` takes all of it off the request's path: a daemon thread drains a queue bounded
in bytes; a hole that does not fit is skipped and counted, never waited for. Until written, a queued hole
reads as stored through `PendingReadsStore` (so the next request reuses it at once), its reuses are
recorded on its row once written (`defer_uses`), a save that then fails is reported like an eviction,
for the scheduler's index to forget (unless the hole was queued again meanwhile), and one written is
reported too (the index then trusts its snapshots for it again). A crash mid-write leaves no readable
partial entry (the disk tier renames complete files only); `close()` flushes what is queued, within a
bound. The thread runs torch on one thread (`cachefuse.torch_threads`: with a team of its own, every
decode step of the engine that shares the process ran ~1.7x slower).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from cachefuse.fusion.saving import HoleSave, HoleWriter, SaveReport
from cachefuse.metadata.base import VariantRecord
from cachefuse.store.base import ChunkKV, KVStore, select_rows
from cachefuse.torch_threads import start_helper_thread

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class QueueDepth:
    """The background writer's queue at one moment (the operator's save-queue gauges)."""

    num_saves: int
    """Holes queued or being written."""
    num_bytes: int
    """Their K/V bytes (what `max_bytes` bounds)."""
    max_bytes: int


class BackgroundSaver:
    """Writes hole saves on one daemon thread, behind the requests that computed them.

    The queue holds at most `max_bytes` of K/V: a save that does not fit is skipped and counted, never
    waited for (the request's path only copies the hole out of the pass). A queued save reads as stored
    (`entry`) until written; one queued twice is written once. Reuses of a queued variant wait with it
    and are recorded right after its row is written (`defer_uses`).

    Args:
        writer: does each write, on the thread.
        max_bytes: the queue's bound (>= 1).
        flush_timeout_s: how long `close()` (also run at interpreter exit, for an engine nobody shut
            down) waits for the queue to be written.
        clock: time source for `flush`'s deadline (injectable: tests never wait on wall time).
    """

    def __init__(self, writer: HoleWriter, max_bytes: int, flush_timeout_s: float = 30.0,
                 clock=time.monotonic) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.writer, self.max_bytes, self.flush_timeout_s, self.clock = writer, max_bytes, flush_timeout_s, clock
        self._cond = threading.Condition()
        self._queue: deque[HoleSave] = deque()
        self._pending: dict[str, HoleSave] = {}  # queued or being written, by store key
        self._deferred_uses: dict[str, list[tuple[str, float]]] = {}  # store key -> (variant id, CFO)
        self._pending_bytes = 0
        self._report = SaveReport()  # what the thread did since the last take_report
        self._closed = False
        self._thread = start_helper_thread(self._run, "cachefuse-hole-writer")
        atexit.register(_close_at_exit, weakref.ref(self))

    @property
    def pending_bytes(self) -> int:
        with self._cond:
            return self._pending_bytes

    def queue_depth(self) -> QueueDepth:
        """What waits now: holes queued or being written, their bytes, and the bound."""
        with self._cond:
            return QueueDepth(len(self._pending), self._pending_bytes, self.max_bytes)

    def submit(self, saves: Sequence[HoleSave]) -> SaveReport:
        """Queues what fits; returns what the request's figures and the scheduler's index learn now
        (queued keys and rows as saved, the rest as skipped)."""
        report = SaveReport()
        with self._cond:
            for save in saves:
                if save.store_key in self._pending:
                    continue  # queued by an earlier request: one write suffices
                nbytes = save.entry.nbytes
                if self._closed or self._pending_bytes + nbytes > self.max_bytes:
                    report.skipped += 1
                    continue
                self._queue.append(save)
                self._pending[save.store_key] = save
                self._pending_bytes += nbytes
                report.saved_keys.append(save.store_key)
                if self.writer.writes_metadata:
                    report.records.append(self.writer.stored_record(save))
                # An earlier save of this variant failed and its report is not taken yet: this one,
                # announced after it, supersedes it (the index must not forget the variant after
                # learning it anew in the same step). The failure still counts.
                variant_id = save.record.variant_id
                if variant_id in self._report.evicted:
                    self._report.evicted = [v for v in self._report.evicted if v != variant_id]
            self._cond.notify_all()
        if report.skipped:
            logger.warning("cachefuse: %d hole save(s) skipped: the writer's queue holds %d of %d bytes",
                           report.skipped, self.pending_bytes, self.max_bytes)
        return report

    def entry(self, store_key: str) -> ChunkKV | None:
        """The queued entry of `store_key` (not yet written), else None. On a GPU its tensors are ready: their
        copy out of the pass (and RoPE strip) ran on the pass's stream, and a reader on another stream (the
        loader's) would otherwise read them before it finished. Long done by the next request, so the wait
        costs nothing in practice."""
        with self._cond:
            save = self._pending.get(store_key)
        if save is None:
            return None
        if save.ready is not None:
            save.ready.synchronize()
        return save.entry

    def pending_records(self) -> list[VariantRecord]:
        """The metadata rows of queued saves, as they will be written (none on ranks that write no rows)."""
        if not self.writer.writes_metadata:
            return []
        with self._cond:
            saves = list(self._pending.values())
        return [self.writer.stored_record(save) for save in saves]

    def defer_uses(self, uses: Sequence[tuple[str, float]]) -> list[tuple[str, float]]:
        """Keeps the reuses of variants whose save is still queued or being written, to record once
        their row exists; returns the others (their rows exist or never will: the caller records them)."""
        rest = []
        with self._cond:
            by_variant = {s.record.variant_id: key for key, s in self._pending.items()}
            for variant_id, cfo in uses:
                key = by_variant.get(variant_id)
                if key is None:
                    rest.append((variant_id, cfo))
                else:
                    self._deferred_uses.setdefault(key, []).append((variant_id, cfo))
        return rest

    def discard(self, store_key: str) -> None:
        """Forgets a queued save not yet taken by the thread (its key is being removed)."""
        with self._cond:
            save = self._pending.get(store_key)
            if save is not None and save in self._queue:
                self._queue.remove(save)
                self._forget(save)

    def pending_keys(self) -> list[str]:
        with self._cond:
            return list(self._pending)

    def take_report(self) -> SaveReport:
        """What the thread did since the last call: evictions, failures (with the failed rows' ids
        under `evicted`, as they were announced saved at submit)."""
        with self._cond:
            report, self._report = self._report, SaveReport()
        return report

    def flush(self, timeout_s: float) -> bool:
        """Waits until everything queued is written, at most `timeout_s`; True if it was."""
        deadline = self.clock() + timeout_s
        with self._cond:
            while self._pending:
                left = deadline - self.clock()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def close(self, timeout_s: float | None = None) -> int:
        """Flushes (within `timeout_s`, default `flush_timeout_s`) and stops the thread; returns how many
        saves were left unwritten. Saves still queued at the deadline are dropped (the metadata store closes
        next: written later, their rows would fail and their K/V be removed again); a save already being
        written cannot be interrupted and finishes on its own. Later submits are skipped. Idempotent."""
        timeout_s = self.flush_timeout_s if timeout_s is None else timeout_s
        flushed = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            left = len(self._pending)
            while self._queue:
                self._forget(self._queue.popleft())
            self._cond.notify_all()
        self._thread.join(timeout=0 if not flushed else max(timeout_s, 0.0))
        if left:
            logger.warning("cachefuse: %d queued hole save(s) not written at shutdown", left)
        return left

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                save = self._queue.popleft()
            try:
                done = self.writer.write(save)
            except Exception:  # noqa: BLE001 - the writer must outlive any one save
                logger.exception("cachefuse: saving hole %s failed", save.store_key)
                done = SaveReport(failures=1)
            written = not done.failures
            if not written:
                done.evicted.append(save.record.variant_id)  # announced at submit: the index forgets it
            while True:
                with self._cond:
                    uses = self._deferred_uses.pop(save.store_key, []) if written else []
                    if not uses:  # still pending until here: a later reuse finds the row and records itself
                        self._forget(save)
                        self._report.add(dataclasses.replace(done, saved_keys=[], records=[],
                                                             written=[save.store_key] if written else []))
                        self._cond.notify_all()
                        break
                self.writer.record_uses(uses)  # outside the lock: a metadata transaction

    def _forget(self, save: HoleSave) -> None:
        """Drops a save from the pending set, with any reuses deferred on it."""
        if self._pending.get(save.store_key) is save:
            del self._pending[save.store_key]
            self._pending_bytes -= save.entry.nbytes
            self._deferred_uses.pop(save.store_key, None)


def _close_at_exit(ref: weakref.ref) -> None:
    saver = ref()
    if saver is not None:
        saver.close()


class PendingReadsStore:
    """The engine's view of its store while a BackgroundSaver has saves queued: a queued hole reads as
    stored, served from the queue (host memory, named as the fastest tier in load figures); everything
    else is the store's own."""

    def __init__(self, store: KVStore, saver: BackgroundSaver) -> None:
        self.inner, self.saver = store, saver
        self.last_hit_tier: str | None = None
        if hasattr(store, "get_layer"):  # else readers take whole entries (store_layer_fetcher's fallback)
            self.get_layer = self._get_layer

    def __getattr__(self, name: str) -> Any:  # tiers, stats, put, pins, capacities: the store's
        return getattr(self.inner, name)

    def _queue_tier(self) -> str:
        tiers = getattr(self.inner, "tiers", None)
        return getattr(tiers[0], "name", "memory") if tiers else getattr(self.inner, "name", "store")

    def contains(self, key: str) -> bool:
        return self.saver.entry(key) is not None or self.inner.contains(key)

    def get(self, key: str) -> ChunkKV | None:
        entry = self.saver.entry(key)
        if entry is not None:
            self.last_hit_tier = self._queue_tier()
            return entry
        entry = self.inner.get(key)
        self.last_hit_tier = getattr(self.inner, "last_hit_tier", None)
        return entry

    def _get_layer(self, key: str, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        entry = self.saver.entry(key)
        if entry is not None:
            self.last_hit_tier = self._queue_tier()
            return entry.k_nope[layer], entry.v[layer]
        kv = self.inner.get_layer(key, layer)
        self.last_hit_tier = getattr(self.inner, "last_hit_tier", None)
        return kv

    def get_rows(self, key: str, layer: int, rows: torch.Tensor | None = None, values: bool = True):
        entry = self.saver.entry(key)
        if entry is not None:
            return select_rows(entry.k_nope[layer], entry.v[layer], rows, values)
        get_rows = getattr(self.inner, "get_rows", None)
        return None if get_rows is None else get_rows(key, layer, rows, values)

    def get_meta(self, key: str) -> dict[str, str] | None:
        entry = self.saver.entry(key)
        if entry is not None:
            return dict(entry.meta)
        get_meta = getattr(self.inner, "get_meta", None)
        return None if get_meta is None else get_meta(key)

    def remove(self, key: str) -> None:
        self.saver.discard(key)
        self.inner.remove(key)

    def keys(self) -> list[str]:
        return list(dict.fromkeys([*self.inner.keys(), *self.saver.pending_keys()]))

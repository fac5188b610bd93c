"""Keeps the scheduler's VariantIndex current from a metadata store, on a thread of its own.

Imports only the standard library and cachefuse.metadata.{base, index}: the vLLM scheduler starts it at
start-up (cachefuse.vllm.scheduler_side.index), so it loads no torch. Choosing variants is index.py's;
this module only reads snapshots of the store and swaps them in (`VariantIndex.snapshot_started`,
`VariantIndex.replace_all`), which keep what the worker announced and removed meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable

from cachefuse.metadata.base import MetaStore, VariantRecord
from cachefuse.metadata.index import VariantIndex

logger = logging.getLogger(__name__)


class IndexRefresher:
    """Keeps a VariantIndex current from a metadata store on a daemon thread, never on the caller's.

    Every `interval_s` it reads the store's `generation()`; when it changed, it reloads and swaps the
    snapshot in. A reload reads every variant's id and version (`variant_versions`: no row is parsed)
    and reads only the rows whose version it has not read before: new variants, rows written since
    (an upsert, a use, a removal and a new save of the same id), and none of the others; removed ones
    drop out with their ids. It keeps the rows it read from the store, never the index's own records
    (those include announcements not written yet). Parsing every row cost ~3 s of the scheduler
    process's CPU per reload at 10,000 variants, about once a second under load, competing with
    `schedule()` for the GIL, and held a shared Redis for 0.3 s per engine. A row that does not parse is
    remembered by its version and not read again until it changes. The first reload, and the first after
    `full_interval_s`, read every row (a backstop). Errors (a Redis that is down, paused or answering
    garbage) are logged once per outage and retried at the next tick; the index keeps its last snapshot
    meanwhile.

    Args:
        index: the index to refresh.
        open_store: builds the metastore connection (called on the thread, again after an error).
        interval_s: seconds between polls.
        plain_keys: called on each reload for rule 3's plain K/V keys (None: keep the index's).
        plain_tier: the tier `plain_keys` lists (rule 6), e.g. "disk"; None: not known.
        full_interval_s: seconds between reloads of every row.
        clock: seconds, for `full_interval_s` (injectable).
    """

    def __init__(self, index: VariantIndex, open_store: Callable[[], MetaStore], interval_s: float,
                 plain_keys: Callable[[], Iterable[str]] | None = None, plain_tier: str | None = None,
                 full_interval_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        # A weak reference: the thread ends once the index's owner (the scheduler) is gone, even if
        # nobody called stop() (an engine that failed after start-up, a test that dropped it).
        self._index_ref = weakref.ref(index)
        self._open, self.interval_s, self._plain_keys = open_store, interval_s, plain_keys
        self._plain_tier = plain_tier
        self._stop = threading.Event()
        self._seen_generation: int | None = None
        self.full_interval_s, self._clock = full_interval_s, clock
        self._last_full: float | None = None
        self._rows: dict[str, tuple[tuple, VariantRecord | None]] = {}  # id -> (version, its row as read)
        self.reloads = 0
        self.full_reloads = 0
        self.rows_read = 0
        """Rows read and parsed over all reloads (an incremental reload reads only those written since)."""
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="cachefuse-index-refresh", daemon=True)

    def start(self) -> IndexRefresher:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def refresh_once(self, store: MetaStore, full: bool | None = None) -> bool:
        """One poll; True when the index was reloaded. `full`: read every row (None: when due)."""
        generation = store.generation()
        if generation == self._seen_generation:
            return False
        index = self._index_ref()
        if index is None:
            return False
        now = self._clock()
        if full is None:
            full = self._last_full is None or now - self._last_full >= self.full_interval_s
        index.snapshot_started()
        records = self._read_rows(store, full)
        if full:
            self._last_full = now
            self.full_reloads += 1
        plain = None if self._plain_keys is None else list(self._plain_keys())
        index.replace_all(records, plain, self._plain_tier)
        self._seen_generation = generation
        self.reloads += 1
        return True

    def _read_rows(self, store: MetaStore, full: bool) -> list[VariantRecord]:
        """The store's readable variants in insertion order, reading the rows whose version this refresher
        has not read (all of them when `full`). Versions are listed first: a row written after its
        version was listed is read again next time, never kept at a version it does not have."""
        versions = store.variant_versions()
        stale = [vid for vid, version in versions if full or self._rows.get(vid, (None,))[0] != version]
        fetched = {record.variant_id: record for record in (store.all_records() if full else store.get_many(stale))}
        self.rows_read += len(fetched)
        read_now = set(stale)
        rows = {}
        for vid, version in versions:  # None: unreadable (or removed meanwhile)
            rows[vid] = (version, fetched.get(vid)) if vid in read_now else self._rows[vid]
        self._rows = rows
        return [record for _, record in rows.values() if record is not None]

    def _run(self) -> None:
        store, failing = None, False
        while not self._stop.wait(self.interval_s) and self._index_ref() is not None:
            try:
                if store is None:
                    store = self._open()
                self.refresh_once(store)
                if failing:
                    logger.info("cachefuse index refresh: metadata store reachable again")
                failing = False
            except Exception as exc:  # noqa: BLE001 - any failure leaves the last snapshot in place
                self.errors += 1
                if not failing:
                    logger.warning("cachefuse index refresh failed (%s: %s); keeping the last snapshot",
                                   type(exc).__name__, exc)
                failing = True
                _close_quietly(store)
                store = None  # reopened on the next poll
        _close_quietly(store)


def _close_quietly(store: MetaStore | None) -> None:
    """Closes the refresher's own store handle, if any; a failing close changes nothing for it."""
    if store is not None:
        try:
            store.close()
        except Exception:  # noqa: BLE001
            pass

"""Variant metadata in one SQLite file next to the disk tier: the `MetaStore` contract of
`cachefuse.metadata.base` (choices 1-7 there), plus the choice below.

Imports the standard library, `cachefuse.metadata.{base, scores}` and `cachefuse.errors`; no torch, no
vllm: the scheduler reads it. SQLite-only behaviour is pinned in tests/metadata/test_sqlite.py.

8. Journal. The SQLite file uses a rollback journal (TRUNCATE), not WAL: WAL's shared-memory index
   is an mmap'd `-shm` file, and when that file cannot be written or extended (an immutable or
   read-only store directory) a read through the mapping raises SIGBUS, which kills the whole vLLM
   engine (seen in tests/vllm/test_failures.py). With a journal, an unwritable directory makes writes
   fail with an error the caller turns into a miss. Writes are few (a row per saved hole, one
   transaction of f_r updates per request, `record_uses`), so WAL's concurrency is not needed;
   readers (`cachefuse inspect`, another process's index refresh) see committed states only.
9. Waiting for a busy file. Another process holding the file's lock (a write, `BEGIN EXCLUSIVE` in an
   sqlite3 shell, a backup) makes a call wait: up to SQLite's busy timeout (2 s) by default, which offline
   jobs and the background hole writer keep. A request's calls run inside `waiting_within(budget)` instead:
   no SQLite wait, each call retried every `WAIT_SLICE_S` while the request's `WaitBudget` lasts (the
   budget is shared by all the request's calls, the connection's in-process lock included: a background
   write waiting out its 2 s holds it), then refused with StoreError. Unpinning never waits (pins have
   their own lock).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from cachefuse.errors import ConfigError, StoreError
from cachefuse.metadata import scores
from cachefuse.metadata.base import POLICIES, PinCounts, VariantRecord, WaitBudget, merged_upsert

_T = TypeVar("_T")

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
META_FILE = "meta.sqlite"
"""The SQLite file's name inside the disk tier's directory (never a K/V key: keys have no dot)."""
BUSY_TIMEOUT_MS = 2000
"""SQLite's own wait for another process's lock, outside a request's budget (choice 9): a write lasts
milliseconds, and an offline job or the background writer would rather wait than drop its work."""
WAIT_SLICE_S = 0.005
"""Within a request's budget, how long a call sleeps between tries of a busy file (choice 9)."""
_SPENT_S = 1e-6
"""A budget with less left than this is spent (a sleep of the rounding error left would never end it)."""

_COLUMNS = ("variant_id", "chunk_key", "prefix", "inter", "intra", "num_tokens", "prefix_num_tokens",
            "ranked_tokens", "cci", "access_count", "f_r", "size_bytes", "tier", "last_access",
            "recompute_ratio", "has_stats", "exact_after", "neighbour_fused")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS variants (
    seq INTEGER PRIMARY KEY,            -- insertion order; explicit so VACUUM keeps it
    variant_id TEXT NOT NULL UNIQUE,
    chunk_key TEXT NOT NULL,
    prefix TEXT NOT NULL,               -- JSON list of chunk keys, prompt order
    inter TEXT NOT NULL,                -- JSON object: prefix chunk key -> float
    intra REAL NOT NULL,
    num_tokens INTEGER NOT NULL,
    prefix_num_tokens TEXT NOT NULL,    -- JSON object: prefix chunk key -> int
    ranked_tokens TEXT NOT NULL,        -- JSON list of token offsets, highest inter-attention first
    cci REAL NOT NULL,                  -- derived (scores.cci), kept for inspection
    access_count INTEGER NOT NULL,
    f_r REAL NOT NULL,
    size_bytes INTEGER NOT NULL,
    tier TEXT NOT NULL,
    last_access REAL NOT NULL,
    recompute_ratio REAL,               -- ratio the prefix was fused under; NULL: computed alone (precompute)
    has_stats INTEGER NOT NULL,         -- 0: no attention statistics (inter/intra are zeros, CCI 0.5)
    rev INTEGER NOT NULL DEFAULT 0,     -- the store's write count when the row was last written
    exact_after TEXT,                   -- chunks.place_hash of the exact place; NULL: approximate (base choice 8)
    neighbour_fused INTEGER NOT NULL DEFAULT 0  -- 1: stored by the offline neighbour step (base choice 9)
);
CREATE INDEX IF NOT EXISTS variants_chunk ON variants (chunk_key);
CREATE TABLE IF NOT EXISTS generation (value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS revision (value INTEGER NOT NULL);
"""
_ORDER = {"f_r": "f_r, last_access, seq", "lru": "last_access, f_r, seq"}


def _row_values(record: VariantRecord) -> tuple:
    return (record.variant_id, record.chunk_key, json.dumps(list(record.prefix)), json.dumps(record.inter),
            record.intra, record.num_tokens, json.dumps(record.prefix_num_tokens),
            json.dumps(list(record.ranked_tokens)), record.cci, record.access_count, record.f_r,
            record.size_bytes, record.tier, record.last_access, record.recompute_ratio, int(record.has_stats),
            record.exact_after, int(record.neighbour_fused))


def _from_row(row: sqlite3.Row) -> VariantRecord:
    """The row's record; ValueError/TypeError/KeyError when it does not parse (damaged, or written by
    something else): callers go through SqliteMetaStore._parse, which turns that into a miss."""
    record = VariantRecord(
        chunk_key=row["chunk_key"], prefix=tuple(json.loads(row["prefix"])), inter=json.loads(row["inter"]),
        intra=row["intra"], num_tokens=row["num_tokens"], prefix_num_tokens=json.loads(row["prefix_num_tokens"]),
        ranked_tokens=tuple(json.loads(row["ranked_tokens"])), access_count=row["access_count"],
        f_r=row["f_r"], size_bytes=row["size_bytes"], tier=row["tier"], last_access=row["last_access"],
        recompute_ratio=row["recompute_ratio"], has_stats=bool(row["has_stats"]),
        # a read-only older store lacks the later columns (a writable one gains them on open)
        exact_after=row["exact_after"] if "exact_after" in row.keys() else None,
        neighbour_fused=bool(row["neighbour_fused"]) if "neighbour_fused" in row.keys() else False)
    if record.variant_id != row["variant_id"]:
        raise ValueError(f"the row holds the fields of variant {record.variant_id!r}")
    return record


def _quiet(parse: Callable[[sqlite3.Row], VariantRecord], row: sqlite3.Row) -> VariantRecord | None:
    """The row's record, or None when it does not parse: a put replaces a damaged row whole, uncounted."""
    try:
        return parse(row)
    except (ValueError, TypeError, KeyError, ArithmeticError, RecursionError):
        return None


def _is_busy(exc: sqlite3.Error) -> bool:
    """Another connection holds the lock this call needs ("database is locked"): worth another try."""
    return getattr(exc, "sqlite_errorcode", None) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED) or (
        isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc))


def _next_revision(cur: sqlite3.Cursor) -> int:
    """The store's next write count (inside the caller's transaction)."""
    cur.execute("UPDATE revision SET value = value + 1")
    return int(cur.execute("SELECT value FROM revision").fetchone()[0])


class SqliteMetaStore:
    """Variant metadata in one SQLite file, budgeted to `max_variants` (see the module docstring).

    Thread-safe: one connection (`check_same_thread=False`) guarded by one lock; every multi-step
    operation is one `BEGIN IMMEDIATE` transaction, so a crash leaves the old or the new state. Pins have
    a lock of their own, taken after the connection's where both are needed.
    """

    def __init__(self, path: str, *, max_variants: int, policy: str = "f_r",
                 clock: Callable[[], float] = time.time, uri: bool = False,
                 wait_clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        """Open or create the store.

        Args:
            path: the database file (conventionally next to the disk tier), or ":memory:".
            max_variants: N x M, the total variant budget over all chunks (>= 1).
            policy: "f_r" (Cache-Craft, lowest f_r evicted first) or "lru" (the baseline).
            clock: seconds, stamped into `last_access`; injectable for tests.
            uri: `path` is a SQLite URI (e.g. "file:...?mode=ro" to read without writing, as
                `cachefuse inspect` does; the schema must then exist already).
            wait_clock, sleep: how calls inside `waiting_within` measure and spend their waits for a busy
                file (choice 9); injectable so tests count waits instead of timing them.

        Raises:
            StoreError: the file cannot be opened as this store (corrupt, truncated, locked past the busy
                timeout, unwritable, or of another schema version).
        """
        if max_variants < 1:
            raise ConfigError(f"max_variants={max_variants!r}, expected >= 1")
        if policy not in POLICIES:
            raise ConfigError(f"policy={policy!r}, expected one of {POLICIES}")
        self.max_variants, self.policy, self._clock = max_variants, policy, clock
        self._wait_clock, self._sleep = wait_clock, sleep
        self._lock = threading.Lock()
        self._pins_lock = threading.Lock()
        self._pins = PinCounts()
        self._budgets = threading.local()  # this thread's WaitBudget, inside waiting_within
        self._busy_timeout_ms = BUSY_TIMEOUT_MS
        self.unreadable_rows = 0
        """Rows skipped because they did not parse (damaged, or written by something else)."""
        self.busy_waits = 0
        """Sleeps of calls inside a budget that found the file (or this process's connection) busy."""
        self.busy_refusals = 0
        """Calls inside a budget refused because it ran out while the file stayed busy."""
        try:
            self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, uri=uri)
            self._open(path, uri)
        except sqlite3.Error as exc:  # corrupt, truncated, locked, unwritable: the caller decides, not SQLite
            if hasattr(self, "_conn"):
                self._conn.close()
            raise StoreError(f"{path}: cannot open the metadata store ({type(exc).__name__}: {exc})") from exc

    def _open(self, path: str, uri: bool) -> None:
        self._conn.row_factory = sqlite3.Row
        if uri and "mode=ro" in path:
            self._check_schema(path)
            return
        self._conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")  # choice 9
        if path != ":memory:":
            self._conn.execute("PRAGMA journal_mode=TRUNCATE")  # choice 8: no mmap'd -shm file
            with contextlib.suppress(OSError):  # owner only, like the K/V files (a file we do not own stays)
                os.chmod(path, 0o600)  # SQLite gives its journal the database file's mode
        self._conn.executescript(_SCHEMA)  # autocommit mode: each CREATE ... IF NOT EXISTS commits alone
        with self._txn() as cur:
            rows = cur.execute("SELECT version FROM schema_version").fetchall()
            if not rows:
                cur.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            elif [r[0] for r in rows] != [SCHEMA_VERSION]:
                raise StoreError(f"{path}: schema version {[r[0] for r in rows]}, expected [{SCHEMA_VERSION}]")
            if cur.execute("SELECT COUNT(*) FROM generation").fetchone()[0] == 0:
                cur.execute("INSERT INTO generation (value) VALUES (0)")
            if cur.execute("SELECT COUNT(*) FROM revision").fetchone()[0] == 0:
                cur.execute("INSERT INTO revision (value) VALUES (0)")
            columns = {row[1] for row in cur.execute("PRAGMA table_info(variants)")}
            if "rev" not in columns:  # written before revs
                cur.execute("ALTER TABLE variants ADD COLUMN rev INTEGER NOT NULL DEFAULT 0")
            if "exact_after" not in columns:
                # written before exact places: its rows claim none (approximate), which is always safe
                cur.execute("ALTER TABLE variants ADD COLUMN exact_after TEXT")
            if "neighbour_fused" not in columns:
                # written before origins: its rows read as not neighbour-fused, so rule 8 loads their base
                # variants until the neighbour step marks its variants again (it does so on a re-run)
                cur.execute("ALTER TABLE variants ADD COLUMN neighbour_fused INTEGER NOT NULL DEFAULT 0")

    def _check_schema(self, path: str) -> None:
        try:
            rows = self._conn.execute("SELECT version FROM schema_version").fetchall()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{path}: not a cachefuse metadata store ({exc})") from exc
        if [r[0] for r in rows] != [SCHEMA_VERSION]:
            raise StoreError(f"{path}: schema version {[r[0] for r in rows]}, expected [{SCHEMA_VERSION}]")

    @contextlib.contextmanager
    def _txn(self) -> Iterator[sqlite3.Cursor]:
        """One write transaction (the caller, `_call`, holds the connection's lock)."""
        cur = self._conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            yield cur
            # Inside the try: a COMMIT refused while another process reads ("database is locked") leaves
            # the transaction open, holding the write lock; it must be rolled back, or this connection
            # can never write again and every other engine on the file is locked out with it.
            cur.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:  # a failed statement may have rolled it back already
                cur.execute("ROLLBACK")
            raise

    @contextlib.contextmanager
    def waiting_within(self, budget: WaitBudget) -> Iterator[None]:
        """This thread's calls inside the block wait for a busy file at most what is left of `budget`, all
        together (choice 9), and charge it. Never hold the block across a yield to other work."""
        outer = getattr(self._budgets, "budget", None)
        self._budgets.budget = budget
        try:
            yield
        finally:
            self._budgets.budget = outer

    def _call(self, body: Callable[[], _T]) -> _T:
        """`body` under the connection's lock, SQLite errors as StoreError (the callers' contract). Outside a
        budget: once, SQLite waiting up to BUSY_TIMEOUT_MS for a busy file. Inside one (choice 9): tried with
        no SQLite wait, again every WAIT_SLICE_S while the budget lasts (a failed try has changed nothing:
        its transaction was rolled back), then refused."""
        budget: WaitBudget | None = getattr(self._budgets, "budget", None)
        if budget is None:
            with self._lock:
                self._set_busy_timeout(BUSY_TIMEOUT_MS)
                return self._translated(body)
        while True:
            start = self._wait_clock()
            try:
                if self._lock.acquire(blocking=False):  # another thread's call may be waiting out its 2 s
                    try:
                        self._set_busy_timeout(0)
                        return body()
                    except sqlite3.Error as exc:
                        if not _is_busy(exc):
                            raise StoreError(f"metadata store: {type(exc).__name__}: {exc}") from exc
                    finally:
                        self._lock.release()
                left = budget.left_s() - (self._wait_clock() - start)
                if left <= _SPENT_S:
                    self.busy_refusals += 1
                    raise StoreError(f"metadata store: busy (locked by another connection) past this request's "
                                     f"wait budget of {budget.seconds:g} s")
                self.busy_waits += 1
                self._sleep(min(WAIT_SLICE_S, left))
            finally:
                budget.charge(self._wait_clock() - start)

    def _translated(self, body: Callable[[], _T]) -> _T:
        try:
            return body()
        except sqlite3.Error as exc:
            raise StoreError(f"metadata store: {type(exc).__name__}: {exc}") from exc

    def _set_busy_timeout(self, ms: int) -> None:
        """SQLite's own wait on this connection (caller holds the lock); set only when it changes."""
        if ms != self._busy_timeout_ms:
            self._conn.execute(f"PRAGMA busy_timeout={ms}")
            self._busy_timeout_ms = ms

    def put(self, record: VariantRecord) -> list[VariantRecord]:
        """Insert or replace `record` (last_access := clock()), evicting on demand when full.

        Returns:
            The evicted variants (empty when none): the caller deletes their K/V.

        Raises:
            StoreError: the store is full and too few variants are unpinned; nothing changed.
        """
        return self._call(lambda: self._put(dataclasses.replace(record, last_access=self._clock())))

    def _put(self, record: VariantRecord) -> list[VariantRecord]:
        with self._txn() as cur:
            exists = cur.execute("SELECT * FROM variants WHERE variant_id = ?", (record.variant_id,)).fetchone()
            if exists is not None:
                record = merged_upsert(_quiet(_from_row, exists), record)
            evicted: list[VariantRecord] = []
            if exists is None:
                count = cur.execute("SELECT COUNT(*) FROM variants").fetchone()[0]
                evicted = self._victims(cur, count + 1 - self.max_variants)
                cur.executemany("DELETE FROM variants WHERE variant_id = ?", [(r.variant_id,) for r in evicted])
            updates = ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS[1:])
            cur.execute(f"INSERT INTO variants ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
                        f"ON CONFLICT (variant_id) DO UPDATE SET {updates}", _row_values(record))
            cur.execute("UPDATE variants SET rev = ? WHERE variant_id = ?", (_next_revision(cur), record.variant_id))
            if exists is None:
                cur.execute("UPDATE generation SET value = value + 1")
        return evicted

    def _victims(self, cur: sqlite3.Cursor, need: int) -> list[VariantRecord]:
        """The first `need` unpinned variants in eviction order; StoreError when there are fewer.

        An unreadable row in that order counts toward `need` and is deleted here (its K/V, if any, becomes
        an orphan that `cachefuse inspect` lists): it is garbage, and no record can be returned for it.
        """
        victims: list[VariantRecord] = []
        unreadable: list[str] = []
        if need <= 0:
            return victims
        for row in cur.execute(f"SELECT * FROM variants ORDER BY {_ORDER[self.policy]}"):
            with self._pins_lock:
                pinned = self._pins.count(row["variant_id"]) > 0
            if not pinned:
                record = self._parse(row)
                if record is None:
                    unreadable.append(row["variant_id"])
                else:
                    victims.append(record)
                if len(victims) + len(unreadable) == need:
                    break
        else:
            raise StoreError(f"metastore full: {self.max_variants} variants, {len(victims) + len(unreadable)} "
                             f"unpinned, {need} must be evicted to admit a new one; not admitted")
        cur.executemany("DELETE FROM variants WHERE variant_id = ?", [(v,) for v in unreadable])
        return victims

    def get(self, variant_id: str) -> VariantRecord | None:
        """The variant with this id, or None."""
        row = self._call(lambda: self._conn.execute(
            "SELECT * FROM variants WHERE variant_id = ?", (variant_id,)).fetchone())
        return None if row is None else self._parse(row)

    def variant_versions(self) -> list[tuple[str, tuple]]:
        """(id, version) of every variant in insertion order, without parsing the rows (an index refresh's
        cheap part). The version is the row's revision: the store's write count when the row was last
        written (a put, an upsert, a use, a new put after a removal), whatever the clock says."""
        return self._call(lambda: [(row[0], (row[1],)) for row in self._conn.execute(
            "SELECT variant_id, rev FROM variants ORDER BY seq")])

    def get_many(self, variant_ids: Sequence[str]) -> list[VariantRecord]:
        """The readable variants among `variant_ids`, in insertion order (absent and unreadable ones skipped)."""
        rows = self._call(lambda: self._rows_with_ids("*", variant_ids))
        rows.sort(key=lambda row: row["seq"])
        return [record for record in map(self._parse, rows) if record is not None]

    def _rows_with_ids(self, columns: str, variant_ids: Sequence[str]) -> list[sqlite3.Row]:
        """`columns` of the rows among `variant_ids` (each once; caller holds the lock), in batches under
        SQLite's bound on query parameters."""
        ids, rows = list(dict.fromkeys(variant_ids)), []
        for begin in range(0, len(ids), 500):
            part = ids[begin:begin + 500]
            rows += self._conn.execute(
                f"SELECT {columns} FROM variants WHERE variant_id IN ({','.join('?' * len(part))})", part).fetchall()
        return rows

    def variants(self, chunk_key: str) -> list[VariantRecord]:
        """The chunk's variants in insertion order (empty: a miss)."""
        rows = self._call(lambda: self._conn.execute("SELECT * FROM variants WHERE chunk_key = ? ORDER BY seq",
                                                     (chunk_key,)).fetchall())
        return [record for record in map(self._parse, rows) if record is not None]

    def choose(self, chunk_key: str, new_prefix: Sequence[str],
               alpha: float) -> tuple[VariantRecord, float] | None:
        """The variant to reuse after `new_prefix` and its CFO (scores.choose_variant), or None on a miss."""
        records = self.variants(chunk_key)
        if not records:
            return None
        index, cfo_value = scores.choose_variant([r.to_variant() for r in records], new_prefix, alpha)
        return records[index], cfo_value

    def record_use(self, variant_id: str, cfo: float, eps: float = 1e-6) -> VariantRecord | None:
        """Persist one reuse: access_count += 1, f_r += 1 / max(CFO, eps) (scores.record_use), last_access.

        Returns:
            The updated record, or None when the variant is gone (evicted or removed).
        """
        def use() -> VariantRecord | None:
            with self._txn() as cur:
                row = cur.execute("SELECT * FROM variants WHERE variant_id = ?", (variant_id,)).fetchone()
                record = None if row is None else self._parse(row)
                if record is None:
                    return None
                variant = record.to_variant()
                scores.record_use(variant, cfo, eps)
                record = dataclasses.replace(record, access_count=variant.access_count, f_r=variant.f_r,
                                             last_access=self._clock())
                cur.execute("UPDATE variants SET access_count = ?, f_r = ?, last_access = ?, rev = ? "
                            "WHERE variant_id = ?", (record.access_count, record.f_r, record.last_access,
                                                     _next_revision(cur), variant_id))
            return record

        return self._call(use)

    def record_uses(self, uses: Sequence[tuple[str, float]], eps: float = 1e-6) -> int:
        """`record_use` for several (variant id, CFO) pairs in one transaction (one request's reuses).

        Returns:
            How many of the variants still existed.
        """
        if not uses:
            return 0
        now = self._clock()

        def use_all() -> int:
            found = 0
            with self._txn() as cur:
                rev = _next_revision(cur)  # one write of the store: every row it changes gets it
                for variant_id, cfo in uses:
                    row = cur.execute("SELECT * FROM variants WHERE variant_id = ?", (variant_id,)).fetchone()
                    record = None if row is None else self._parse(row)
                    if record is None:
                        continue
                    variant = record.to_variant()
                    scores.record_use(variant, cfo, eps)
                    cur.execute("UPDATE variants SET access_count = ?, f_r = ?, last_access = ?, rev = ? "
                                "WHERE variant_id = ?", (variant.access_count, variant.f_r, now, rev, variant_id))
                    found += 1
            return found

        return self._call(use_all)

    def remove(self, variant_id: str) -> VariantRecord | None:
        """Delete a variant; returns it, or None when absent. StoreError when it is pinned."""
        def delete() -> sqlite3.Row | None:
            with self._txn() as cur:
                with self._pins_lock:
                    self._pins.check_unpinned(variant_id)
                row = cur.execute("SELECT * FROM variants WHERE variant_id = ?", (variant_id,)).fetchone()
                if row is not None:
                    cur.execute("DELETE FROM variants WHERE variant_id = ?", (variant_id,))
                    cur.execute("UPDATE generation SET value = value + 1")
            return row

        row = self._call(delete)
        return None if row is None else self._parse(row)  # a damaged row is removed all the same

    def generation(self) -> int:
        """A counter that changes whenever the set of variants changes (choice 7), in any process."""
        return self._call(lambda: int(self._conn.execute("SELECT value FROM generation").fetchone()[0]))

    def pin(self, variant_id: str) -> None:
        """Protect a stored variant from eviction until the matching unpin (nested). KeyError if absent."""
        if not self.pin_many([variant_id]):
            raise KeyError(variant_id)

    def pin_many(self, variant_ids: Sequence[str]) -> list[str]:
        """`pin` of every variant that exists, in one read; returns those pinned (absent ones are skipped)."""
        def pin_found() -> list[str]:
            found = {row[0] for row in self._rows_with_ids("variant_id", variant_ids)}
            pinned = [variant_id for variant_id in variant_ids if variant_id in found]
            with self._pins_lock:  # under the connection's lock too: no put chooses victims meanwhile
                for variant_id in pinned:
                    self._pins.add(variant_id)
            return pinned

        return self._call(pin_found)

    def unpin(self, variant_id: str) -> None:
        """Undo one pin; StoreError when the variant is not pinned (an unbalanced unpin is a bug). Never
        waits for the file or the connection (choice 9)."""
        with self._pins_lock:
            self._pins.release(variant_id)

    def pin_count(self, variant_id: str) -> int:
        """How many pins the variant holds (0 when unpinned or absent)."""
        with self._pins_lock:
            return self._pins.count(variant_id)

    def count(self) -> int:
        """The number of stored variants, over all chunks (<= max_variants when the store began empty)."""
        return self._call(lambda: self._conn.execute("SELECT COUNT(*) FROM variants").fetchone()[0])

    def all_records(self) -> list[VariantRecord]:
        """Every variant, in insertion order."""
        rows = self._call(lambda: self._conn.execute("SELECT * FROM variants ORDER BY seq").fetchall())
        return [record for record in map(self._parse, rows) if record is not None]

    def _parse(self, row: sqlite3.Row) -> VariantRecord | None:
        """The row's record, or None (logged and counted in `unreadable_rows`) when it does not parse:
        one damaged row is a miss for its variant, never an error for every other one."""
        try:
            return _from_row(row)
        except (ValueError, TypeError, KeyError, ArithmeticError, RecursionError) as exc:
            # json.JSONDecodeError is a ValueError; a deeply nested value a RecursionError
            self.unreadable_rows += 1
            logger.warning("metadata store: unreadable variant row %r skipped (%s: %s)", row["variant_id"],
                           type(exc).__name__, exc)
            return None

    def size_by_tier(self) -> dict[str, int]:
        """tier -> total size_bytes of its variants (what a per-tier byte budget checks against)."""
        rows = self._call(lambda: self._conn.execute(
            "SELECT tier, SUM(size_bytes) FROM variants GROUP BY tier").fetchall())
        return {tier: int(total) for tier, total in rows}

    def close(self) -> None:
        """Close the connection (idempotent); pins are dropped."""
        with self._lock, self._pins_lock:
            self._conn.close()
            self._pins.clear()

    def __enter__(self) -> SqliteMetaStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

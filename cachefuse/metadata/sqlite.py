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

from cachefuse.errors import ConfigError, StoreError
from cachefuse.metadata import scores
from cachefuse.metadata.base import POLICIES, PinCounts, VariantRecord, merged_upsert

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
META_FILE = "meta.sqlite"
"""The SQLite file's name inside the disk tier's directory (never a K/V key: keys have no dot)."""

_COLUMNS = ("variant_id", "chunk_key", "prefix", "inter", "intra", "num_tokens", "prefix_num_tokens",
            "ranked_tokens", "cci", "access_count", "f_r", "size_bytes", "tier", "last_access",
            "recompute_ratio", "has_stats")
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
    rev INTEGER NOT NULL DEFAULT 0      -- the store's write count when the row was last written
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
            record.size_bytes, record.tier, record.last_access, record.recompute_ratio, int(record.has_stats))


def _from_row(row: sqlite3.Row) -> VariantRecord:
    """The row's record; ValueError/TypeError/KeyError when it does not parse (damaged, or written by
    something else): callers go through SqliteMetaStore._parse, which turns that into a miss."""
    record = VariantRecord(
        chunk_key=row["chunk_key"], prefix=tuple(json.loads(row["prefix"])), inter=json.loads(row["inter"]),
        intra=row["intra"], num_tokens=row["num_tokens"], prefix_num_tokens=json.loads(row["prefix_num_tokens"]),
        ranked_tokens=tuple(json.loads(row["ranked_tokens"])), access_count=row["access_count"],
        f_r=row["f_r"], size_bytes=row["size_bytes"], tier=row["tier"], last_access=row["last_access"],
        recompute_ratio=row["recompute_ratio"], has_stats=bool(row["has_stats"]))
    if record.variant_id != row["variant_id"]:
        raise ValueError(f"the row holds the fields of variant {record.variant_id!r}")
    return record


def _quiet(parse: Callable[[sqlite3.Row], VariantRecord], row: sqlite3.Row) -> VariantRecord | None:
    """The row's record, or None when it does not parse: a put replaces a damaged row whole, uncounted."""
    try:
        return parse(row)
    except (ValueError, TypeError, KeyError, ArithmeticError, RecursionError):
        return None


def _next_revision(cur: sqlite3.Cursor) -> int:
    """The store's next write count (inside the caller's transaction)."""
    cur.execute("UPDATE revision SET value = value + 1")
    return int(cur.execute("SELECT value FROM revision").fetchone()[0])


class SqliteMetaStore:
    """Variant metadata in one SQLite file, budgeted to `max_variants` (see the module docstring).

    Thread-safe: one connection (`check_same_thread=False`) guarded by one lock; every multi-step
    operation is one `BEGIN IMMEDIATE` transaction, so a crash leaves the old or the new state.
    """

    def __init__(self, path: str, *, max_variants: int, policy: str = "f_r",
                 clock: Callable[[], float] = time.time, uri: bool = False) -> None:
        """Open or create the store.

        Args:
            path: the database file (conventionally next to the disk tier), or ":memory:".
            max_variants: N x M, the total variant budget over all chunks (>= 1).
            policy: "f_r" (Cache-Craft, lowest f_r evicted first) or "lru" (the baseline).
            clock: seconds, stamped into `last_access`; injectable for tests.
            uri: `path` is a SQLite URI (e.g. "file:...?mode=ro" to read without writing, as
                `cachefuse inspect` does; the schema must then exist already).

        Raises:
            StoreError: the file cannot be opened as this store (corrupt, truncated, locked past the busy
                timeout, unwritable, or of another schema version).
        """
        if max_variants < 1:
            raise ConfigError(f"max_variants={max_variants!r}, expected >= 1")
        if policy not in POLICIES:
            raise ConfigError(f"policy={policy!r}, expected one of {POLICIES}")
        self.max_variants, self.policy, self._clock = max_variants, policy, clock
        self._lock = threading.Lock()
        self._pins = PinCounts()
        self.unreadable_rows = 0
        """Rows skipped because they did not parse (damaged, or written by something else)."""
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
        self._conn.execute("PRAGMA busy_timeout=2000")  # another process's write lasts milliseconds
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
            if "rev" not in {row[1] for row in cur.execute("PRAGMA table_info(variants)")}:  # written before revs
                cur.execute("ALTER TABLE variants ADD COLUMN rev INTEGER NOT NULL DEFAULT 0")

    def _check_schema(self, path: str) -> None:
        try:
            rows = self._conn.execute("SELECT version FROM schema_version").fetchall()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{path}: not a cachefuse metadata store ({exc})") from exc
        if [r[0] for r in rows] != [SCHEMA_VERSION]:
            raise StoreError(f"{path}: schema version {[r[0] for r in rows]}, expected [{SCHEMA_VERSION}]")

    @contextlib.contextmanager
    def _txn(self) -> Iterator[sqlite3.Cursor]:
        """One write transaction; any SQLite failure (I/O error, full disk, locked) is a StoreError."""
        with self._locked():
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
    def _locked(self) -> Iterator[None]:
        """The connection's lock; SQLite errors leave as StoreError (the callers' contract)."""
        with self._lock:
            try:
                yield
            except sqlite3.Error as exc:
                raise StoreError(f"metadata store: {type(exc).__name__}: {exc}") from exc

    def put(self, record: VariantRecord) -> list[VariantRecord]:
        """Insert or replace `record` (last_access := clock()), evicting on demand when full.

        Returns:
            The evicted variants (empty when none): the caller deletes their K/V.

        Raises:
            StoreError: the store is full and too few variants are unpinned; nothing changed.
        """
        record = dataclasses.replace(record, last_access=self._clock())
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
            if self._pins.count(row["variant_id"]) == 0:
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
        with self._locked():
            row = self._conn.execute("SELECT * FROM variants WHERE variant_id = ?", (variant_id,)).fetchone()
        return None if row is None else self._parse(row)

    def variant_versions(self) -> list[tuple[str, tuple]]:
        """(id, version) of every variant in insertion order, without parsing the rows (an index refresh's
        cheap part). The version is the row's revision: the store's write count when the row was last
        written (a put, an upsert, a use, a new put after a removal), whatever the clock says."""
        with self._locked():
            return [(row[0], (row[1],)) for row in self._conn.execute(
                "SELECT variant_id, rev FROM variants ORDER BY seq")]

    def get_many(self, variant_ids: Sequence[str]) -> list[VariantRecord]:
        """The readable variants among `variant_ids`, in insertion order (absent and unreadable ones skipped)."""
        with self._locked():
            rows = self._rows_with_ids("*", variant_ids)
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
        with self._locked():
            rows = self._conn.execute("SELECT * FROM variants WHERE chunk_key = ? ORDER BY seq",
                                      (chunk_key,)).fetchall()
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
        with self._txn() as cur:
            row = cur.execute("SELECT * FROM variants WHERE variant_id = ?", (variant_id,)).fetchone()
            record = None if row is None else self._parse(row)
            if record is None:
                return None
            variant = record.to_variant()
            scores.record_use(variant, cfo, eps)
            record = dataclasses.replace(record, access_count=variant.access_count, f_r=variant.f_r,
                                         last_access=self._clock())
            cur.execute("UPDATE variants SET access_count = ?, f_r = ?, last_access = ?, rev = ? WHERE variant_id = ?",
                        (record.access_count, record.f_r, record.last_access, _next_revision(cur), variant_id))
        return record

    def record_uses(self, uses: Sequence[tuple[str, float]], eps: float = 1e-6) -> int:
        """`record_use` for several (variant id, CFO) pairs in one transaction (one request's reuses).

        Returns:
            How many of the variants still existed.
        """
        if not uses:
            return 0
        now, found = self._clock(), 0
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

    def remove(self, variant_id: str) -> VariantRecord | None:
        """Delete a variant; returns it, or None when absent. StoreError when it is pinned."""
        with self._txn() as cur:
            self._pins.check_unpinned(variant_id)
            row = cur.execute("SELECT * FROM variants WHERE variant_id = ?", (variant_id,)).fetchone()
            if row is not None:
                cur.execute("DELETE FROM variants WHERE variant_id = ?", (variant_id,))
                cur.execute("UPDATE generation SET value = value + 1")
        return None if row is None else self._parse(row)  # a damaged row is removed all the same

    def generation(self) -> int:
        """A counter that changes whenever the set of variants changes (choice 7), in any process."""
        with self._locked():
            return int(self._conn.execute("SELECT value FROM generation").fetchone()[0])

    def pin(self, variant_id: str) -> None:
        """Protect a stored variant from eviction until the matching unpin (nested). KeyError if absent."""
        with self._locked():
            if self._conn.execute("SELECT 1 FROM variants WHERE variant_id = ?", (variant_id,)).fetchone() is None:
                raise KeyError(variant_id)
            self._pins.add(variant_id)

    def pin_many(self, variant_ids: Sequence[str]) -> list[str]:
        """`pin` of every variant that exists, in one read; returns those pinned (absent ones are skipped)."""
        with self._locked():
            found = {row[0] for row in self._rows_with_ids("variant_id", variant_ids)}
            pinned = [variant_id for variant_id in variant_ids if variant_id in found]
            for variant_id in pinned:
                self._pins.add(variant_id)
        return pinned

    def unpin(self, variant_id: str) -> None:
        """Undo one pin; StoreError when the variant is not pinned (an unbalanced unpin is a bug)."""
        with self._locked():
            self._pins.release(variant_id)

    def pin_count(self, variant_id: str) -> int:
        """How many pins the variant holds (0 when unpinned or absent)."""
        with self._locked():
            return self._pins.count(variant_id)

    def count(self) -> int:
        """The number of stored variants, over all chunks (<= max_variants when the store began empty)."""
        with self._locked():
            return self._conn.execute("SELECT COUNT(*) FROM variants").fetchone()[0]

    def all_records(self) -> list[VariantRecord]:
        """Every variant, in insertion order."""
        with self._locked():
            rows = self._conn.execute("SELECT * FROM variants ORDER BY seq").fetchall()
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
        with self._locked():
            rows = self._conn.execute("SELECT tier, SUM(size_bytes) FROM variants GROUP BY tier").fetchall()
        return {tier: int(total) for tier, total in rows}

    def close(self) -> None:
        """Close the connection (idempotent); pins are dropped."""
        with self._locked():
            self._conn.close()
            self._pins.clear()

    def __enter__(self) -> SqliteMetaStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""SQLite-only behaviour of cachefuse.metastore (the record type, the journal, the schema version).

Everything both backends share is tests/metadata/test_contract.py's suite.
"""

import sqlite3
import threading

import pytest

from cachefuse.errors import ConfigError, StoreError
from cachefuse.metadata import scores
from cachefuse.metadata.base import VariantRecord, WaitBudget, make_variant_id
from cachefuse.metadata.sqlite import WAIT_SLICE_S, SqliteMetaStore
from tests.metadata.test_contract import FakeClock, c3_after_c1_c2, c3_alone


def open_store(path, **kw) -> SqliteMetaStore:
    kw.setdefault("max_variants", 100)
    kw.setdefault("clock", FakeClock())
    return SqliteMetaStore(str(path), **kw)


def test_record_derives_id_and_cci_from_meta():
    record = c3_after_c1_c2()
    assert record.variant_id == make_variant_id("C3", ("C1", "C2")) and len(record.variant_id) == 16
    assert record.variant_id != make_variant_id("C3", ("C2", "C1"))  # the prefix is ordered
    assert record.variant_id != c3_alone().variant_id
    assert record.cci == pytest.approx(0.7772998611746911)
    assert c3_alone().cci == 0.5
    variant = record.to_variant()
    assert isinstance(variant, scores.Variant) and variant.prefix == ("C1", "C2") and variant.cci == record.cci
    with pytest.raises(ValueError, match="prefix"):
        VariantRecord(chunk_key="C3", prefix=("C1",), inter={}, intra=1.0, num_tokens=4)
    with pytest.raises(ValueError, match="ranked_tokens"):
        c3_alone(ranked_tokens=(0, 4))


def test_persists_across_reopen_with_a_rollback_journal(tmp_path):
    path = tmp_path / "meta.sqlite"
    with open_store(path) as store:
        store.put(c3_after_c1_c2(size_bytes=10))
        store.put(c3_alone(size_bytes=5, tier="cpu"))
        store.record_use(c3_alone().variant_id, 0.5)
        before = store.all_records()
        assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "truncate"  # choice 8
        assert not (tmp_path / "meta.sqlite-shm").exists()  # no mmap'd shared-memory file
        assert store.record_uses([(c3_alone().variant_id, 0.25), ("gone", 0.5)]) == 1  # one transaction
        assert store.get(c3_alone().variant_id).f_r == 6.0
        store.record_uses([(c3_alone().variant_id, 0.25)])
        before = store.all_records()
    with open_store(path) as store:
        assert store.all_records() == before
        assert store.get(c3_alone().variant_id).f_r == 10.0
        assert store.size_by_tier() == {"disk": 10, "cpu": 5}


def test_rejects_other_schema_version_and_bad_config(tmp_path):
    path = tmp_path / "meta.sqlite"
    open_store(path).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE schema_version SET version = 99")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="schema version"):
        open_store(path)
    with pytest.raises(ConfigError, match="max_variants"):
        open_store(tmp_path / "b.sqlite", max_variants=0)
    with pytest.raises(ConfigError, match="policy"):
        open_store(tmp_path / "c.sqlite", policy="lfu")


def _garbage(path):
    path.write_bytes(b"this is not a database\n" * 100)


def _truncated(path):
    with open_store(path) as store:
        store.put(c3_alone())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def _a_directory(path):
    path.mkdir()


def _locked(path):
    with open_store(path):
        pass
    holder = sqlite3.connect(str(path), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process mid-write, for longer than the busy timeout
    return holder


@pytest.mark.parametrize("damage", [_garbage, _truncated, _a_directory, _locked])
def test_a_file_that_cannot_be_opened_is_a_store_error(tmp_path, damage):
    """Never a raw sqlite3 error: the worker turns a StoreError into metadata in memory and starts."""
    path = tmp_path / "meta.sqlite"
    holder = damage(path)
    try:
        with pytest.raises(StoreError, match="meta.sqlite"):
            open_store(path).put(c3_alone())
    finally:
        if holder is not None:
            holder.close()


def test_a_commit_refused_by_a_reader_leaves_the_store_writable(tmp_path):
    """Another process reading the file (an sqlite3 shell, a backup) can make COMMIT fail with "database is
    locked"; SQLite then keeps the transaction open with its write lock. It must be rolled back: this
    store writes again once the reader is gone, the refused row is not seen, and another engine can open
    and write the file."""
    path = tmp_path / "meta.sqlite"
    store = open_store(path)
    store._conn.execute("PRAGMA busy_timeout=50")  # the 2 s wait for the reader, shortened
    store.put(VariantRecord.without_stats("aa", (), 4))
    reader = sqlite3.connect(path, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT * FROM variants").fetchall()  # holds a shared lock: COMMIT cannot finish
    with pytest.raises(StoreError, match="locked"):
        store.put(VariantRecord.without_stats("bb", (), 4))
    assert not store._conn.in_transaction
    reader.execute("COMMIT")
    store.put(VariantRecord.without_stats("cc", (), 4))
    assert sorted(r.chunk_key for r in store.all_records()) == ["aa", "cc"]
    other = open_store(path)
    other.put(VariantRecord.without_stats("dd", (), 4))
    assert sorted(r.chunk_key for r in store.all_records()) == ["aa", "cc", "dd"]


def test_a_store_written_before_revisions_is_migrated_in_place(tmp_path):
    """meta.sqlite files from before the rev column: opened, given the column (rows at revision 0) and the
    counter, and every later write gets a new revision."""
    path = tmp_path / "meta.sqlite"
    with SqliteMetaStore(str(path), max_variants=10, clock=FakeClock()) as store:
        store.put(c3_alone())
    conn = sqlite3.connect(path)  # as an older cachefuse left it: no rev column, no revision table
    columns = ("seq, variant_id, chunk_key, prefix, inter, intra, num_tokens, prefix_num_tokens, ranked_tokens, "
               "cci, access_count, f_r, size_bytes, tier, last_access, recompute_ratio, has_stats")
    conn.executescript(f"""
        CREATE TABLE old (seq INTEGER PRIMARY KEY, variant_id TEXT NOT NULL UNIQUE, chunk_key TEXT NOT NULL,
            prefix TEXT NOT NULL, inter TEXT NOT NULL, intra REAL NOT NULL, num_tokens INTEGER NOT NULL,
            prefix_num_tokens TEXT NOT NULL, ranked_tokens TEXT NOT NULL, cci REAL NOT NULL,
            access_count INTEGER NOT NULL, f_r REAL NOT NULL, size_bytes INTEGER NOT NULL, tier TEXT NOT NULL,
            last_access REAL NOT NULL, recompute_ratio REAL, has_stats INTEGER NOT NULL);
        INSERT INTO old ({columns}) SELECT {columns} FROM variants;
        DROP TABLE variants; ALTER TABLE old RENAME TO variants; DROP TABLE revision;
    """)
    conn.close()
    with SqliteMetaStore(str(path), max_variants=10, clock=FakeClock()) as store:
        (vid, version), = store.variant_versions()
        assert vid == c3_alone().variant_id and version == (0,) and store.get(vid) == store.all_records()[0]
        store.record_use(vid, 0.5)
        assert store.variant_versions() == [(vid, (1,))]
        store.put(c3_after_c1_c2())
        assert [version for _, version in store.variant_versions()] == [(1,), (2,)]


class WaitClock:
    """A monotonic clock that only `sleep` advances: a store's waits for a busy file are counted and summed,
    never timed."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _budgeted_store(path) -> tuple[SqliteMetaStore, WaitClock]:
    clock = WaitClock()
    store = open_store(path, wait_clock=clock, sleep=clock.sleep)
    store.put(c3_alone())
    return store, clock


def _exclusive_holder(path) -> sqlite3.Connection:
    holder = sqlite3.connect(str(path), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process mid-write: readers and writers both locked out
    return holder


def test_calls_within_a_budget_share_it_on_a_locked_file(tmp_path):
    """Inside `waiting_within(budget)`, a file locked by another connection is tried every WAIT_SLICE_S until
    the budget (shared by every call in it) is spent, then refused: a pin, a get, a reuse and a put against
    a 50 ms budget wait 50 ms in all, not 2 s each. Control: the same four calls, each with a budget of its
    own, wait four times as long (what a per-call wait amounts to). Once the file is free, the same store
    works again within a fresh budget."""
    path = tmp_path / "meta.sqlite"
    store, clock = _budgeted_store(path)
    variant_id = c3_alone().variant_id
    calls = [lambda: store.pin_many([variant_id]), lambda: store.get(variant_id),
             lambda: store.record_uses([(variant_id, 0.5)]), lambda: store.put(c3_after_c1_c2())]
    holder = _exclusive_holder(path)
    try:
        budget = WaitBudget(0.05)
        for call in calls:
            with store.waiting_within(budget), pytest.raises(StoreError, match="locked"):
                call()
        assert sum(clock.sleeps) == pytest.approx(0.05) and store.busy_refusals == 4
        assert len(clock.sleeps) == pytest.approx(0.05 / WAIT_SLICE_S, abs=1)  # the first call waited them all
        assert store.pin_count(variant_id) == 0  # a refused pin_many pinned nothing

        clock.sleeps.clear()
        for call in calls:  # control: a budget per call
            with store.waiting_within(WaitBudget(0.05)), pytest.raises(StoreError, match="locked"):
                call()
        assert sum(clock.sleeps) == pytest.approx(4 * 0.05)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    with store.waiting_within(WaitBudget(0.05)):
        assert store.pin_many([variant_id]) == [variant_id]
        assert store.record_uses([(variant_id, 0.5)]) == 1
    store.unpin(variant_id)
    assert store.get(variant_id).access_count == 1


def test_a_lock_released_within_the_budget_costs_only_the_wait(tmp_path):
    """The other process commits while the call waits: the call succeeds on its next try, having waited a
    few slices, and its write is there."""
    path = tmp_path / "meta.sqlite"
    clock = WaitClock()
    holder = None

    def sleep_then_release(seconds: float) -> None:
        clock.sleep(seconds)
        if len(clock.sleeps) == 3:
            holder.execute("COMMIT")

    store = open_store(path, wait_clock=clock, sleep=sleep_then_release)
    store.put(c3_alone())
    holder = _exclusive_holder(path)
    try:
        with store.waiting_within(WaitBudget(0.05)):
            assert store.record_uses([(c3_alone().variant_id, 0.5)]) == 1
    finally:
        holder.close()
    assert len(clock.sleeps) == 3 and store.busy_refusals == 0
    assert store.get(c3_alone().variant_id).access_count == 1


def test_a_budgeted_call_does_not_queue_behind_a_write_waiting_on_the_file(tmp_path):
    """The background hole writer writes outside any budget: on a locked file it waits SQLite's 2 s holding
    the connection. A request's call meanwhile waits only its own budget (the connection's lock counts as
    busy), and an unpin never waits at all. Once the other process lets go, the background write lands."""
    path = tmp_path / "meta.sqlite"
    store, clock = _budgeted_store(path)
    variant_id = c3_alone().variant_id
    assert store.pin_many([variant_id]) == [variant_id]
    holder = _exclusive_holder(path)
    outcome = []
    writer = threading.Thread(target=lambda: outcome.append(store.put(c3_after_c1_c2())))
    writer.start()
    try:
        while not store._lock.locked():  # the writer holds the connection, waiting on the file
            threading.Event().wait(0.001)
        with store.waiting_within(WaitBudget(0.05)), pytest.raises(StoreError, match="locked"):
            store.get(variant_id)
        assert sum(clock.sleeps) == pytest.approx(0.05) and writer.is_alive()
        store.unpin(variant_id)  # returns although the connection is taken
        assert store.pin_count(variant_id) == 0
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        writer.join(timeout=10)
    assert outcome == [[]] and store.get(c3_after_c1_c2().variant_id) is not None

"""cachefuse.metastore: SQLite persistence, variant choice, f_r bookkeeping, budget and eviction."""

import dataclasses
import sqlite3
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefuse import meta
from cachefuse.errors import ConfigError, StoreError
from cachefuse.metastore import SqliteMetaStore, VariantRecord, make_variant_id


class FakeClock:
    """Strictly increasing time: each call returns 1 more than the last."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def c3_after_c1_c2(**kw) -> VariantRecord:
    """tests/test_meta.py's C(C3 | C1 C2): CCI = sigmoid(1.25) = 0.77729986..."""
    return VariantRecord(chunk_key="C3", prefix=("C1", "C2"), inter={"C1": 0.5, "C2": 1.5}, intra=2.0,
                         num_tokens=4, prefix_num_tokens={"C1": 2, "C2": 4}, **kw)


def c3_alone(**kw) -> VariantRecord:
    """C3 with no prefix: CCI = 0.5."""
    return VariantRecord(chunk_key="C3", prefix=(), inter={}, intra=4.0, num_tokens=4, **kw)


def alone(chunk_key: str, **kw) -> VariantRecord:
    return VariantRecord(chunk_key=chunk_key, prefix=(), inter={}, intra=1.0, num_tokens=2, **kw)


def open_store(path, **kw) -> SqliteMetaStore:
    kw.setdefault("max_variants", 100)
    kw.setdefault("clock", FakeClock())
    return SqliteMetaStore(str(path), **kw)


# --------------------------------------------------------------------------- records and persistence


def test_record_derives_id_and_cci_from_meta():
    record = c3_after_c1_c2()
    assert record.variant_id == make_variant_id("C3", ("C1", "C2")) and len(record.variant_id) == 16
    assert record.variant_id != make_variant_id("C3", ("C2", "C1"))  # the prefix is ordered
    assert record.variant_id != c3_alone().variant_id
    assert record.cci == pytest.approx(0.7772998611746911)
    assert c3_alone().cci == 0.5
    variant = record.to_variant()
    assert isinstance(variant, meta.Variant) and variant.prefix == ("C1", "C2") and variant.cci == record.cci
    with pytest.raises(ValueError, match="prefix"):
        VariantRecord(chunk_key="C3", prefix=("C1",), inter={}, intra=1.0, num_tokens=4)
    with pytest.raises(ValueError, match="ranked_tokens"):
        c3_alone(ranked_tokens=(0, 4))


def test_round_trip_upsert_variants_remove(tmp_path):
    clock = FakeClock()
    store = open_store(tmp_path / "meta.sqlite", clock=clock)
    record = c3_after_c1_c2(ranked_tokens=(3, 0, 2), access_count=2, f_r=1.25, size_bytes=4096, tier="cpu")
    assert store.put(record) == []
    got = store.get(record.variant_id)
    assert got == dataclasses.replace(record, last_access=1.0)  # put stamps last_access
    assert isinstance(got.prefix, tuple) and isinstance(got.ranked_tokens, tuple)
    assert got.inter == {"C1": 0.5, "C2": 1.5} and got.prefix_num_tokens == {"C1": 2, "C2": 4}

    store.put(c3_alone())
    store.put(alone("C9"))
    store.put(dataclasses.replace(record, f_r=0.0, tier="disk"))  # upsert: replaced, keeps its order
    assert store.count() == 3
    assert [r.prefix for r in store.variants("C3")] == [("C1", "C2"), ()]
    assert store.get(record.variant_id).f_r == 0.0 and store.get(record.variant_id).tier == "disk"
    assert store.variants("nope") == [] and store.get("nope") is None
    assert store.size_by_tier() == {"disk": 4096}

    assert store.remove(record.variant_id).variant_id == record.variant_id
    assert store.remove(record.variant_id) is None
    assert [r.chunk_key for r in store.all_records()] == ["C3", "C9"]
    store.close()


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
        store.put(c3_alone(size_bytes=5, tier="cpu", f_r=2.0, access_count=1))  # back to `before`
        before = store.all_records()
    with open_store(path) as store:
        assert store.all_records() == before
        assert store.get(c3_alone().variant_id).f_r == 2.0
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


# --------------------------------------------------------------------------- choice and f_r


def test_choose_lowest_cfo_and_record_use(tmp_path):
    store = open_store(tmp_path / "meta.sqlite")
    assert store.choose("C3", ("C1", "C2"), alpha=1.0) is None  # a miss
    after, solo = c3_after_c1_c2(), c3_alone()
    store.put(after)
    store.put(solo)
    # Same prefix: `after` has beta' = 1, CFO 0; `solo` has beta = 0 (empty old prefix), CFO = 0.5.
    record, cfo = store.choose("C3", ("C1", "C2"), alpha=1.0)
    assert (record.variant_id, cfo) == (after.variant_id, 0.0)
    # Swapped prefix: `after` gets gamma = 1, CFO = 0.777...; `solo` still 0.5, so it wins.
    record, cfo = store.choose("C3", ("C2", "C1"), alpha=1.0)
    assert (record.variant_id, cfo) == (solo.variant_id, 0.5)

    updated = store.record_use(solo.variant_id, 0.25)
    assert (updated.access_count, updated.f_r) == (1, 4.0)
    store.record_use(solo.variant_id, 0.0)  # exact match: 1 / eps
    stored = store.get(solo.variant_id)
    assert stored.access_count == 2 and stored.f_r == pytest.approx(4.0 + 1e6)
    assert stored.last_access > updated.last_access > store.get(after.variant_id).last_access
    assert store.record_use("gone", 0.5) is None


def test_concurrent_record_use_counts_every_use(tmp_path):
    store = open_store(tmp_path / "meta.sqlite", clock=lambda: 0.0)
    store.put(c3_alone())
    vid = c3_alone().variant_id

    def work():
        for _ in range(50):
            store.record_use(vid, 0.5)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.get(vid).access_count == 200 and store.get(vid).f_r == 400.0


# --------------------------------------------------------------------------- budget and eviction


def test_budget_is_total_not_per_chunk(tmp_path):
    store = open_store(tmp_path / "meta.sqlite", max_variants=3)
    for prefix in [(), ("A",), ("B",)]:  # one chunk may own the whole budget
        rec = VariantRecord(chunk_key="C", prefix=prefix, inter={k: 1.0 for k in prefix}, intra=1.0,
                            num_tokens=2, prefix_num_tokens={k: 2 for k in prefix})
        assert store.put(rec) == []
    assert store.count() == 3 and len(store.variants("C")) == 3
    assert store.put(dataclasses.replace(rec, f_r=9.0)) == []  # an upsert never evicts


def test_f_r_eviction_pins_and_refusal(tmp_path):
    store = open_store(tmp_path / "meta.sqlite", max_variants=3)
    a, b, c = alone("A", f_r=1.0), alone("B", f_r=5.0), alone("C", f_r=3.0)
    for rec in (a, b, c):
        store.put(rec)
    evicted = store.put(alone("D", f_r=0.0))  # the newcomer does not compete
    assert [r.chunk_key for r in evicted] == ["A"] and evicted[0].f_r == 1.0
    assert sorted(r.chunk_key for r in store.all_records()) == ["B", "C", "D"]

    d = alone("D").variant_id
    store.pin(d)
    store.pin(d)  # nested
    store.unpin(d)
    assert store.pin_count(d) == 1
    assert [r.chunk_key for r in store.put(alone("E"))] == ["C"]  # D (f_r 0) is pinned
    with pytest.raises(StoreError, match="pinned"):
        store.remove(d)

    store.pin(alone("B").variant_id)
    store.pin(alone("E").variant_id)
    before = store.all_records()
    with pytest.raises(StoreError, match="full"):  # everything pinned: refused, nothing changed
        store.put(alone("F"))
    assert store.all_records() == before

    store.unpin(d)
    assert [r.chunk_key for r in store.put(alone("F"))] == ["D"]
    with pytest.raises(StoreError, match="not pinned"):
        store.unpin(d)
    with pytest.raises(KeyError):
        store.pin(d)


def test_lru_policy_evicts_least_recently_used(tmp_path):
    store = open_store(tmp_path / "meta.sqlite", max_variants=3, policy="lru")
    for key, f_r in (("A", 0.0), ("B", 9.0), ("C", 5.0)):
        store.put(alone(key, f_r=f_r))
    store.record_use(alone("A").variant_id, 0.5)  # A: lowest f_r but most recently used
    assert [r.chunk_key for r in store.put(alone("D"))] == ["B"]
    assert [r.chunk_key for r in store.put(alone("E"))] == ["C"]


# --------------------------------------------------------------------------- property


KEYS = [alone(chunk) for chunk in "ABCDEF"]
OPS = st.lists(st.tuples(st.sampled_from(["put", "use", "pin", "unpin", "remove"]),
                         st.integers(0, len(KEYS) - 1), st.sampled_from([0.0, 0.5, 1.0, 2.0])),
               max_size=40)


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(["f_r", "lru"]), max_variants=st.integers(1, 4), ops=OPS)
def test_budget_and_eviction_order_hold_under_random_ops(policy, max_variants, ops):
    store = SqliteMetaStore(":memory:", max_variants=max_variants, policy=policy, clock=FakeClock())
    pins: dict[str, int] = {}
    order = (lambda r: r.f_r) if policy == "f_r" else (lambda r: r.last_access)
    for op, index, value in ops:
        vid = KEYS[index].variant_id
        snapshot = {r.variant_id: r for r in store.all_records()}
        if op == "put":
            unpinned = [r for r in snapshot.values() if not pins.get(r.variant_id)]
            need = len(snapshot) + 1 - max_variants if vid not in snapshot else 0
            if need > len(unpinned):
                with pytest.raises(StoreError):
                    store.put(dataclasses.replace(KEYS[index], f_r=value))
                assert store.all_records() == list(snapshot.values())
                continue
            evicted = store.put(dataclasses.replace(KEYS[index], f_r=value))
            assert len(evicted) == max(need, 0)
            survivors = [r for r in unpinned if r.variant_id not in {e.variant_id for e in evicted}]
            for e in evicted:
                assert not pins.get(e.variant_id) and snapshot[e.variant_id] == e
                assert all(order(e) <= order(s) for s in survivors)
        elif op == "use":
            got = store.record_use(vid, value)
            assert (got is None) == (vid not in snapshot)
        elif op == "pin":
            if vid in snapshot:
                store.pin(vid)
                pins[vid] = pins.get(vid, 0) + 1
            else:
                with pytest.raises(KeyError):
                    store.pin(vid)
        elif op == "unpin":
            if pins.get(vid):
                store.unpin(vid)
                pins[vid] -= 1
            else:
                with pytest.raises(StoreError):
                    store.unpin(vid)
        elif pins.get(vid):
            with pytest.raises(StoreError):
                store.remove(vid)
        else:
            assert (store.remove(vid) is None) == (vid not in snapshot)
        assert store.count() <= max_variants
        assert all(store.pin_count(k) == n for k, n in pins.items())
        assert all(store.get(k) is not None for k, n in pins.items() if n)
    store.close()

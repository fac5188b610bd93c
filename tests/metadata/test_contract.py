"""The MetaStore contract (cachefuse/metadata/base.py, choices 1-7), one suite over both backends.

Every test takes `open_store`, a factory for the backend under test: "sqlite" (a file under tmp_path)
or "redis" (a namespace of its own on the session's shared server). Calling it with the same `name`
reopens the same data, as a second process would. SQLite-only behaviour (journal, schema version) stays in
tests/metadata/test_sqlite.py; Redis-only failure behaviour in tests/metadata/test_redis.py.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefuse.errors import ConfigError, StoreError
from cachefuse.metadata.base import MetaStore, VariantRecord
from cachefuse.metadata.redis import RedisMetaStore
from cachefuse.metadata.sqlite import SqliteMetaStore
from tests.helpers.redis_server import delete_namespace


class FakeClock:
    """Strictly increasing time: each call returns 1 more than the last."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def c3_after_c1_c2(**kw) -> VariantRecord:
    """C(C3 | C1 C2): CCI = sigmoid(1.25)."""
    return VariantRecord(chunk_key="C3", prefix=("C1", "C2"), inter={"C1": 0.5, "C2": 1.5}, intra=2.0,
                         num_tokens=4, prefix_num_tokens={"C1": 2, "C2": 4}, **kw)


def c3_alone(**kw) -> VariantRecord:
    """C3 with no prefix: CCI = 0.5."""
    return VariantRecord(chunk_key="C3", prefix=(), inter={}, intra=4.0, num_tokens=4, **kw)


def alone(chunk_key: str, **kw) -> VariantRecord:
    return VariantRecord(chunk_key=chunk_key, prefix=(), inter={}, intra=1.0, num_tokens=2, **kw)


OpenStore = Callable[..., MetaStore]


@pytest.fixture(params=["sqlite", "redis"])
def open_store(request, tmp_path) -> Iterator[OpenStore]:
    """`open_store(name="main", **kw)`: a store of the backend under test; the same name, the same data."""
    opened: list[MetaStore] = []
    namespaces: dict[str, str] = {}
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None

    def make(name: str = "main", **kw) -> MetaStore:
        kw.setdefault("max_variants", 100)
        kw.setdefault("clock", FakeClock())
        if url is None:
            store = SqliteMetaStore(str(tmp_path / f"{name}.sqlite"), **kw)
        else:
            namespace = namespaces.setdefault(name, f"test-{uuid.uuid4().hex[:12]}")
            store = RedisMetaStore(url, namespace=namespace, **kw)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()
    if url is not None:
        client = redis.Redis.from_url(url)
        for namespace in namespaces.values():
            delete_namespace(client, namespace)
        client.close()


# --------------------------------------------------------------------------- records and persistence


def test_exact_place_round_trips_and_an_upsert_takes_the_new_one(open_store):
    """exact_after (choice 8) is stored and read back; a put of the same variant writes new K/V, so its
    place (or its lack of one) replaces the old, even when the old record's statistics are kept."""
    store = open_store()
    store.put(c3_after_c1_c2(exact_after="a" * 32))
    assert store.get(c3_after_c1_c2().variant_id).exact_after == "a" * 32
    store.put(VariantRecord.without_stats("C3", ("C1", "C2"), 4))  # no statistics, no place
    again = store.get(c3_after_c1_c2().variant_id)
    assert again.has_stats and again.exact_after is None
    store.put(alone("C4", exact_after="b" * 32))
    assert store.variants("C4")[0].exact_after == "b" * 32


def test_neighbour_origin_round_trips_and_an_upsert_takes_the_new_one(open_store):
    """neighbour_fused (choice 9) is stored and read back by every list read and after a reopen; a put of the
    same variant writes new K/V, so its origin replaces the old one either way."""
    store = open_store()
    store.put(c3_after_c1_c2(neighbour_fused=True))
    store.put(alone("C4"))
    variant_id = c3_after_c1_c2().variant_id
    assert store.get(variant_id).neighbour_fused
    assert {r.chunk_key: r.neighbour_fused for r in store.all_records()} == {"C3": True, "C4": False}
    assert [r.neighbour_fused for r in store.variants("C3")] == [True]
    assert [r.neighbour_fused for r in store.get_many([variant_id])] == [True]
    assert open_store().get(variant_id).neighbour_fused  # the same data, another connection
    store.record_use(variant_id, 0.5)
    assert store.get(variant_id).neighbour_fused  # a use leaves the origin alone
    store.put(c3_after_c1_c2())  # the same variant saved again by a served request: not the step's any more
    assert not store.get(variant_id).neighbour_fused
    store.put(VariantRecord.without_stats("C3", ("C1", "C2"), 4, neighbour_fused=True))  # statistics kept
    again = store.get(variant_id)
    assert again.neighbour_fused and again.has_stats


def test_round_trip_upsert_variants_remove(open_store):
    store = open_store()
    assert isinstance(store, MetaStore)
    record = c3_after_c1_c2(ranked_tokens=(3, 0, 2), access_count=2, f_r=1.25, size_bytes=4096, tier="cpu",
                            recompute_ratio=0.15)
    assert store.put(record) == []
    got = store.get(record.variant_id)
    assert got == dataclasses.replace(record, last_access=1.0)  # put stamps last_access
    assert isinstance(got.prefix, tuple) and isinstance(got.ranked_tokens, tuple)
    assert got.inter == {"C1": 0.5, "C2": 1.5} and got.prefix_num_tokens == {"C1": 2, "C2": 4}
    stats_less = VariantRecord.without_stats("C7", ("C1",), 3)
    store.put(stats_less)
    assert store.get(stats_less.variant_id) == dataclasses.replace(stats_less, last_access=2.0)

    store.put(c3_alone())
    store.put(alone("C9"))
    store.put(dataclasses.replace(record, f_r=0.0, tier="disk"))  # upsert: replaced, keeps its order and uses
    assert store.count() == 4
    assert [r.prefix for r in store.variants("C3")] == [("C1", "C2"), ()]
    assert store.get(record.variant_id).f_r == 1.25 and store.get(record.variant_id).tier == "disk"
    assert store.variants("nope") == [] and store.get("nope") is None
    assert store.size_by_tier() == {"disk": 4096}

    assert store.remove(record.variant_id).variant_id == record.variant_id
    assert store.remove(record.variant_id) is None
    assert [r.chunk_key for r in store.all_records()] == ["C7", "C3", "C9"]


def test_persists_across_reopen_and_is_shared(open_store):
    store = open_store()
    store.put(c3_after_c1_c2(size_bytes=10))
    store.put(c3_alone(size_bytes=5, tier="cpu"))
    store.record_use(c3_alone().variant_id, 0.5)
    before = store.all_records()
    other = open_store()  # a second process on the same data, while the first is open
    assert other.all_records() == before
    generation = other.generation()
    store.put(alone("C9"))
    assert other.generation() != generation and other.get(alone("C9").variant_id) is not None
    store.close()
    reopened = open_store()
    assert reopened.get(c3_alone().variant_id).f_r == 2.0
    assert reopened.size_by_tier() == {"disk": 10, "cpu": 5}
    assert open_store("elsewhere").count() == 0  # another file / namespace is another store


def test_rejects_bad_config(open_store):
    with pytest.raises(ConfigError, match="max_variants"):
        open_store(max_variants=0)
    with pytest.raises(ConfigError, match="policy"):
        open_store(policy="lfu")


# --------------------------------------------------------------------------- choice and f_r


def test_choose_lowest_cfo_and_record_use(open_store):
    store = open_store()
    assert store.choose("C3", ("C1", "C2"), alpha=1.0) is None  # a miss
    after, solo = c3_after_c1_c2(), c3_alone()
    store.put(after)
    store.put(solo)
    record, cfo = store.choose("C3", ("C1", "C2"), alpha=1.0)  # same prefix: CFO 0 beats 0.5
    assert (record.variant_id, cfo) == (after.variant_id, 0.0)
    record, cfo = store.choose("C3", ("C2", "C1"), alpha=1.0)  # swapped: 0.777... loses to 0.5
    assert (record.variant_id, cfo) == (solo.variant_id, 0.5)

    updated = store.record_use(solo.variant_id, 0.25)
    assert (updated.access_count, updated.f_r) == (1, 4.0)
    store.record_use(solo.variant_id, 0.0)  # exact match: 1 / eps
    store.record_use(solo.variant_id, 3.0)
    stored = store.get(solo.variant_id)
    assert stored.access_count == 3 and stored.f_r == 4.0 + 1.0 / 1e-6 + 1.0 / 3.0  # bit-exact doubles
    assert stored.last_access > updated.last_access > store.get(after.variant_id).last_access
    assert store.record_use("gone", 0.5) is None
    with pytest.raises(ValueError, match="eps"):
        store.record_use(solo.variant_id, 0.5, eps=0.0)


def test_concurrent_record_use_counts_every_use(open_store):
    store = open_store(clock=lambda: 0.0)
    store.put(c3_alone())
    vid = c3_alone().variant_id
    other = open_store(clock=lambda: 0.0)  # a second instance on the same data

    def work(s: MetaStore) -> None:
        for _ in range(25):
            s.record_use(vid, 0.5)

    threads = [threading.Thread(target=work, args=(s,)) for s in (store, store, other, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.get(vid).access_count == 100 and store.get(vid).f_r == 200.0


# --------------------------------------------------------------------------- budget and eviction


def test_budget_is_total_not_per_chunk(open_store):
    store = open_store(max_variants=3)
    for prefix in [(), ("A",), ("B",)]:  # one chunk may own the whole budget
        rec = VariantRecord(chunk_key="C", prefix=prefix, inter={k: 1.0 for k in prefix}, intra=1.0,
                            num_tokens=2, prefix_num_tokens={k: 2 for k in prefix})
        assert store.put(rec) == []
    assert store.count() == 3 and len(store.variants("C")) == 3
    assert store.put(dataclasses.replace(rec, f_r=9.0)) == []  # an upsert never evicts
    assert [r.chunk_key for r in store.put(alone("D"))] == ["C"]  # another chunk's variant makes room
    assert store.count() == 3


def test_f_r_eviction_pins_and_refusal(open_store):
    store = open_store(max_variants=3)
    a, b, c = alone("A", f_r=1.0), alone("B", f_r=5.0), alone("C", f_r=3.0)
    for rec in (a, b, c):
        store.put(rec)
    evicted = store.put(alone("D", f_r=0.0))  # the newcomer does not compete
    assert [r.chunk_key for r in evicted] == ["A"] and evicted[0] == dataclasses.replace(a, last_access=1.0)
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
    before, generation = store.all_records(), store.generation()
    with pytest.raises(StoreError, match="full"):  # everything pinned: refused, nothing changed
        store.put(alone("F"))
    assert store.all_records() == before and store.generation() == generation

    store.unpin(d)
    assert [r.chunk_key for r in store.put(alone("F"))] == ["D"]
    with pytest.raises(StoreError, match="not pinned"):
        store.unpin(d)
    with pytest.raises(KeyError):
        store.pin(d)


def test_pin_many_and_record_uses_act_on_what_exists(open_store):
    """One call per request (a slow Redis costs its latency once, not once per chunk)."""
    store = open_store(max_variants=3)
    a, b = alone("A", f_r=1.0), alone("B", f_r=5.0)
    store.put(a)
    store.put(b)
    assert store.pin_many([a.variant_id, "gone", b.variant_id, a.variant_id]) == [a.variant_id, b.variant_id,
                                                                                 a.variant_id]
    assert store.pin_count(a.variant_id) == 2 and store.pin_count(b.variant_id) == 1 and store.pin_count("gone") == 0
    store.put(alone("C", f_r=9.0))
    assert [r.chunk_key for r in store.put(alone("D"))] == ["C"]  # A (lowest f_r) and B are pinned
    assert store.pin_many([]) == []
    assert store.record_uses([(a.variant_id, 0.5), ("gone", 0.5), (b.variant_id, 0.25)]) == 2
    assert store.get(a.variant_id).f_r == pytest.approx(3.0) and store.get(b.variant_id).f_r == pytest.approx(9.0)
    assert store.get(a.variant_id).access_count == 1 and store.record_uses([]) == 0


def test_f_r_ties_go_to_least_recently_used_then_oldest(open_store):
    store = open_store(max_variants=3)
    for key in "ABC":
        store.put(alone(key, f_r=1.0))
    store.record_use(alone("A").variant_id, 1.0)  # A: f_r 2.0
    store.put(alone("B", f_r=1.0))  # upsert: B used after C now
    assert [r.chunk_key for r in store.put(alone("D", f_r=1.0))] == ["C"]
    assert [r.chunk_key for r in store.put(alone("E"))] == ["B"]


def test_lru_policy_evicts_least_recently_used(open_store):
    store = open_store(max_variants=3, policy="lru")
    for key, f_r in (("A", 0.0), ("B", 9.0), ("C", 5.0)):
        store.put(alone(key, f_r=f_r))
    store.record_use(alone("A").variant_id, 0.5)  # A: lowest f_r but most recently used
    assert [r.chunk_key for r in store.put(alone("D"))] == ["B"]
    assert [r.chunk_key for r in store.put(alone("E"))] == ["C"]


def test_lru_ties_go_to_lower_f_r_then_oldest(open_store):
    store = open_store(max_variants=3, policy="lru", clock=lambda: 7.0)
    for key, f_r in (("A", 2.0), ("B", 1.0), ("C", 1.0)):
        store.put(alone(key, f_r=f_r))
    assert [r.chunk_key for r in store.put(alone("D", f_r=5.0))] == ["B"]
    assert [r.chunk_key for r in store.put(alone("E", f_r=5.0))] == ["C"]
    assert [r.chunk_key for r in store.put(alone("F"))] == ["A"]


def test_generation_changes_on_membership_change_only(open_store):
    store = open_store(max_variants=2)
    seen = [store.generation()]

    def changed() -> bool:
        seen.append(store.generation())
        return seen[-1] != seen[-2]

    store.put(alone("A"))
    assert changed()
    store.put(alone("A", f_r=3.0))  # upsert
    assert not changed()
    store.record_use(alone("A").variant_id, 0.5)
    store.pin(alone("A").variant_id)
    store.unpin(alone("A").variant_id)
    assert store.get(alone("A").variant_id) is not None and store.all_records() and not changed()
    store.put(alone("B"))
    assert changed()
    store.put(alone("C"))  # evicts one
    assert changed()
    assert store.remove(alone("nope").variant_id) is None
    assert not changed()
    store.remove(alone("C").variant_id)
    assert changed()


# --------------------------------------------------------------------------- property


KEYS = [alone(chunk) for chunk in "ABCDEF"]
OPS = st.lists(st.tuples(st.sampled_from(["put", "use", "pin", "unpin", "remove"]),
                         st.integers(0, len(KEYS) - 1), st.sampled_from([0.0, 0.5, 1.0, 2.0])),
               max_size=30)


def check_random_ops(store: MetaStore, max_variants: int, ops: list[tuple[str, int, float]]) -> None:
    """Apply `ops`; after each, the budget holds, pins hold, and victims are the policy's minimum."""
    pins: dict[str, int] = {}
    key = ((lambda r: (r.f_r, r.last_access)) if store.policy == "f_r"
           else (lambda r: (r.last_access, r.f_r)))
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
                assert all(key(e) <= key(s) for s in survivors)
        elif op == "use":
            assert (store.record_use(vid, value) is None) == (vid not in snapshot)
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


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy=st.sampled_from(["f_r", "lru"]), max_variants=st.integers(1, 4), ops=OPS)
def test_budget_and_eviction_order_hold_under_random_ops(open_store, policy, max_variants, ops):
    store = open_store(name=uuid.uuid4().hex, max_variants=max_variants, policy=policy)
    check_random_ops(store, max_variants, ops)
    store.close()


def test_a_row_past_the_bounds_is_unreadable(open_store, monkeypatch):
    """Planning pays for a variant's prefix length in `schedule()`: a row with a longer prefix than any
    engine saves (a foreign writer's; 300,000 chunks cost 1 s per request) is skipped like a damaged one."""
    from cachefuse.metadata import base

    store = open_store(max_variants=3)
    long_prefix = c3_after_c1_c2()  # two prefix chunks
    store.put(long_prefix)
    assert store.get(long_prefix.variant_id) is not None  # control: within the bound
    monkeypatch.setattr(base, "MAX_PREFIX_CHUNKS", 1)
    assert store.get(long_prefix.variant_id) is None and store.unreadable_rows == 1
    assert store.all_records() == []


def corrupt_row(store: MetaStore, variant_id: str, field: str = "inter", value: str = "{not json") -> None:
    """What a damaged disk block or another writer leaves: one field of one stored variant unreadable."""
    if isinstance(store, SqliteMetaStore):
        store._conn.execute(f"UPDATE variants SET {field} = ? WHERE variant_id = ?", (value, variant_id))
    else:
        store._client.hset(store._prefix + "v:" + variant_id, field, value)


@pytest.mark.parametrize(("field", "value"), [("inter", "{not json"), ("prefix", "[1, 2"),
                                               ("num_tokens", "many"), ("ranked_tokens", "[99]"),
                                               ("ranked_tokens", "[0, true]"), ("ranked_tokens", "[0, -1]"),
                                               ("ranked_tokens", "[0, 1.0]"), ("ranked_tokens", '[0, "1"]'),
                                               ("ranked_tokens", json.dumps([0, 1, 2, 3] * 3))])  # > num_tokens
def test_an_unreadable_row_is_a_counted_miss_that_hides_nothing_else(open_store, field, value):
    store = open_store(max_variants=3)
    good, bad = alone("C1"), c3_after_c1_c2()
    store.put(good)
    store.put(bad)
    corrupt_row(store, bad.variant_id, field, value)
    assert store.get(bad.variant_id) is None and store.unreadable_rows == 1
    assert [r.variant_id for r in store.all_records()] == [good.variant_id]  # the rest stays visible
    assert store.variants("C3") == [] and store.choose("C3", ("C1",), 1.0) is None
    assert store.record_use(bad.variant_id, 0.5) is None and store.record_uses([(bad.variant_id, 0.5)]) == 0
    store.put(bad)  # a save of the same variant replaces the damaged row
    assert store.get(bad.variant_id) == dataclasses.replace(bad, last_access=store.get(bad.variant_id).last_access)


def test_eviction_removes_an_unreadable_row_and_admits_the_new_variant(open_store):
    store = open_store(max_variants=2)
    store.put(alone("C1"))
    store.put(alone("C2"))
    corrupt_row(store, alone("C1").variant_id)
    evicted = store.put(alone("C4"))
    assert store.count() == 2 and store.get(alone("C4").variant_id) is not None
    assert [r.variant_id for r in evicted] in ([], [alone("C2").variant_id])
    assert alone("C1").variant_id not in {r.variant_id for r in store.all_records()}


# --------------------------------------------------------------------------- incremental index reloads


@pytest.mark.parametrize("clock", ["advancing", "constant"])
def test_an_incremental_reload_equals_a_full_one_and_reads_only_changed_rows(open_store, clock):
    """Another engine puts, upserts, uses, evicts, removes and saves again; this engine announces saves of
    its own. After each change the index refreshed incrementally (versions, then only rows written since
    it read them) holds what a full reload of every row holds, and reads at most the rows written. With a
    constant clock too: a version made of the row's stamps missed upserts that changed only tier, size or
    statistics, and SQLite reused a removed row's seq."""
    import random

    from cachefuse.metadata.index import VariantIndex
    from cachefuse.metadata.refresher import IndexRefresher

    store = open_store(max_variants=6, **({"clock": lambda: 1.0} if clock == "constant" else {}))
    incremental, full = VariantIndex(), VariantIndex()
    refresher = IndexRefresher(incremental, lambda: store, 3600, full_interval_s=1e9)
    reference = IndexRefresher(full, lambda: store, 3600)
    rng = random.Random(3)
    assert refresher.refresh_once(store) and refresher.full_reloads == 1  # the first load reads every row
    live: list[VariantRecord] = []
    written = 0  # rows written since the last reload (an upsert or a use changes no generation: no reload)
    for step in range(60):
        roll = rng.random()
        written += 1
        if live and roll < 0.2:
            store.remove(live.pop(rng.randrange(len(live))).variant_id)
        elif live and roll < 0.35:  # an upsert and a use: rows changed in place
            record = live[rng.randrange(len(live))]
            store.put(dataclasses.replace(record, intra=rng.random() * 9, tier=rng.choice(["disk", "redis"])))
            store.record_use(record.variant_id, 0.5)
        elif roll < 0.5 and live:  # evicted or removed, then saved again under the same id
            record = live.pop(rng.randrange(len(live)))
            store.remove(record.variant_id)
            again = dataclasses.replace(record, intra=rng.random() * 9)
            store.put(again)
            live.append(again)
        else:
            record = alone(f"K{step}", f_r=rng.random())
            if rng.random() < 0.3:  # this engine's own save, announced before another engine's row lands
                incremental.announce([VariantRecord.without_stats(record.chunk_key, (), record.num_tokens)])
                full.announce([VariantRecord.without_stats(record.chunk_key, (), record.num_tokens)])
            evicted = {e.variant_id for e in store.put(record)}
            live = [r for r in live if r.variant_id not in evicted] + [record]
        before = refresher.rows_read
        if refresher.refresh_once(store):
            assert reference.refresh_once(store, full=True)
            assert sorted(map(repr, incremental.records())) == sorted(map(repr, full.records())), step
            assert refresher.rows_read - before <= written
            written = 0
    assert refresher.full_reloads == 1


def test_an_unreadable_row_is_not_read_again_until_it_changes(open_store):
    from cachefuse.metadata.index import VariantIndex
    from cachefuse.metadata.refresher import IndexRefresher

    store = open_store(max_variants=5)
    good, bad = alone("A"), c3_after_c1_c2()
    store.put(good)
    store.put(bad)
    corrupt_row(store, bad.variant_id)
    index = VariantIndex()  # the refresher holds it weakly
    refresher = IndexRefresher(index, lambda: store, 3600, full_interval_s=1e9)
    assert refresher.refresh_once(store) and store.unreadable_rows == 1
    for key in "BC":
        store.put(alone(key))
        assert refresher.refresh_once(store)
    assert store.unreadable_rows == 1  # read once, not at every reload
    store.put(bad)  # repaired: a new version, read again
    store.put(alone("D"))
    assert refresher.refresh_once(store) and bad.chunk_key in index


def test_an_upsert_keeps_the_uses_and_the_statistics_it_would_lose(open_store):
    """Two engines save the same variant at once (each checked before the other's row existed): the later
    put replaced every field, resetting a popular variant's f_r and access count (first in line for
    eviction) and, from a save without statistics, dropping the ranking."""
    store = open_store(max_variants=3)
    with_stats = c3_after_c1_c2(ranked_tokens=(3, 0, 2))
    store.put(with_stats)
    for _ in range(5):
        store.record_use(with_stats.variant_id, 0.1)
    popular = store.get(with_stats.variant_id)
    assert popular.access_count == 5 and popular.f_r == pytest.approx(50.0)
    late = VariantRecord.without_stats(with_stats.chunk_key, with_stats.prefix, with_stats.num_tokens,
                                       dict(with_stats.prefix_num_tokens))
    assert late.variant_id == with_stats.variant_id
    store.put(late)
    kept = store.get(with_stats.variant_id)
    assert kept.access_count == 5 and kept.f_r == pytest.approx(50.0)
    assert kept.has_stats and kept.ranked_tokens == (3, 0, 2) and kept.inter == with_stats.inter
    richer = dataclasses.replace(with_stats, ranked_tokens=(0, 2, 3), intra=9.0)
    store.put(richer)  # statistics replace statistics
    assert store.get(with_stats.variant_id).ranked_tokens == (0, 2, 3) and store.get(with_stats.variant_id).f_r == 50.0

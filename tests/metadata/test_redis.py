"""RedisMetaStore when Redis fails: every call raises StoreError within the hang guard, never hangs,
and the same instance works again once the server is back. (The contract itself is in
tests/metadata/test_contract.py.)"""

from __future__ import annotations

import time

import pytest

from cachefuse.errors import StoreError
from cachefuse.metadata.base import VariantRecord
from cachefuse.metadata.redis import RedisMetaStore
from tests.helpers.redis_server import DroppingProxy

HANG_GUARD_S = 5.0  # bounded by timeout_s; this only catches a hang


def alone(chunk_key: str, **kw) -> VariantRecord:
    return VariantRecord(chunk_key=chunk_key, prefix=(), inter={}, intra=1.0, num_tokens=2, **kw)


CALLS = {
    "put": lambda s: s.put(alone("B")),
    "get": lambda s: s.get(alone("A").variant_id),
    "variants": lambda s: s.variants("A"),
    "choose": lambda s: s.choose("A", (), alpha=1.0),
    "record_use": lambda s: s.record_use(alone("A").variant_id, 0.5),
    "remove": lambda s: s.remove(alone("A").variant_id),
    "pin": lambda s: s.pin(alone("A").variant_id),
    "pin_many": lambda s: s.pin_many([alone("A").variant_id]),
    "record_uses": lambda s: s.record_uses([(alone("A").variant_id, 0.5)]),
    "count": lambda s: s.count(),
    "all_records": lambda s: s.all_records(),
    "size_by_tier": lambda s: s.size_by_tier(),
    "generation": lambda s: s.generation(),
}


def _assert_every_call_raises_fast(store: RedisMetaStore) -> None:
    for name, call in CALLS.items():
        start = time.monotonic()
        with pytest.raises(StoreError, match="redis metastore"):
            call(store)
        assert time.monotonic() - start < HANG_GUARD_S, name


def _assert_works(store: RedisMetaStore) -> None:
    store.put(alone("C"))
    assert store.record_use(alone("C").variant_id, 0.5).access_count == 1


def test_stopped_server_raises_store_error_then_recovers(private_redis):
    store = RedisMetaStore(private_redis.url, max_variants=10, clock=lambda: 1.0, timeout_s=0.2)
    store.put(alone("A"))
    private_redis.stop()
    _assert_every_call_raises_fast(store)
    opened_while_down = RedisMetaStore(private_redis.url, max_variants=10, timeout_s=0.2)  # starts all the same
    _assert_every_call_raises_fast(opened_while_down)
    private_redis.start()  # empty: no persistence
    assert store.all_records() == []
    _assert_works(store)
    assert opened_while_down.count() == 1  # the layout check happened at the first call that got through


def test_another_layout_version_fails_at_once(private_redis):
    with private_redis.client() as raw:
        raw.set("cachefuse:meta:schema_version", "999")
    with pytest.raises(StoreError, match="layout version"):
        RedisMetaStore(private_redis.url, max_variants=10, timeout_s=0.2)


def test_paused_server_raises_store_error_then_recovers(private_redis):
    """A server that does not answer costs two timeouts, not one per call: once a second timeout comes a
    whole timeout after the first with no answer between, calls are not sent for OUTAGE_BACKOFF_S and
    raise at once; then they are sent again."""
    from cachefuse.redis_client import OUTAGE_BACKOFF_S

    store = RedisMetaStore(private_redis.url, max_variants=10, clock=lambda: 1.0, timeout_s=0.1)
    now = [0.0]
    store._outage.clock = lambda: now[0]
    store.put(alone("A"))
    with private_redis.frozen():  # every reply waits until the block ends, however loaded the machine
        start = time.monotonic()
        for name in ("get", "record_use", "put", "all_records", "generation"):
            now[0] += OUTAGE_BACKOFF_S  # each call sent, and timing out
            with pytest.raises(StoreError, match="Timeout"):
                CALLS[name](store)
        for name in ("get", "put"):  # within the backoff: not sent
            with pytest.raises(StoreError, match="not sent"):
                CALLS[name](store)
        assert time.monotonic() - start < HANG_GUARD_S
    now[0] += OUTAGE_BACKOFF_S
    # NOTE: a timed-out call has an unknown outcome (Redis 7.0 drops the queued commands of a client
    # that hung up, but a slow network may deliver them): whole or not at all, never half.
    records = {r.chunk_key: r for r in store.all_records()}
    assert set(records) in ({"A"}, {"A", "B"}) and records["A"].access_count in (0, 1)
    _assert_works(store)


def test_dropped_connections_raise_store_error_then_recover(private_redis):
    with DroppingProxy(private_redis.port) as proxy:
        store = RedisMetaStore(proxy.url(), max_variants=10, clock=lambda: 1.0, timeout_s=0.5)
        store.put(alone("A"))
        proxy.set_mode("reset")
        _assert_every_call_raises_fast(store)
        proxy.set_mode("forward")
        assert [r.chunk_key for r in store.all_records()] == ["A"]
        _assert_works(store)


def test_pins_survive_an_outage(private_redis):
    store = RedisMetaStore(private_redis.url, max_variants=1, clock=lambda: 1.0, timeout_s=0.2)
    now = [0.0]
    store._outage.clock = lambda: now[0]
    store.put(alone("A"))
    store.pin(alone("A").variant_id)
    with private_redis.frozen(), pytest.raises(StoreError):
        store.put(alone("B"))
    now[0] = 60.0  # past the outage backoff
    assert store.pin_count(alone("A").variant_id) == 1
    with pytest.raises(StoreError, match="full"):  # A is still pinned here: B is refused
        store.put(alone("B"))
    store.unpin(alone("A").variant_id)
    assert [r.chunk_key for r in store.put(alone("B"))] == ["A"]


def test_an_unreadable_variant_is_skipped_by_list_reads(redis_url, redis_namespace, redis_server):
    store = RedisMetaStore(redis_url, max_variants=10, clock=lambda: 1.0, namespace=redis_namespace)
    store.put(alone("A"))
    store.put(alone("B"))
    damaged = alone("A").variant_id
    with redis_server.client() as raw:
        raw.hset(f"{redis_namespace}:meta:v:{damaged}", "inter", "{not json")
    assert [r.chunk_key for r in store.all_records()] == ["B"] and store.variants("A") == []
    assert store.get(damaged) is None and store.unreadable_rows >= 1  # a miss, as in SQLite (the contract)
    assert store.remove(damaged) is None  # the damaged hash is removed all the same
    assert store.count() == 1


def test_a_redis_restarted_empty_shows_a_new_generation_at_the_same_count(private_redis):
    """Restarted empty, then three saves: the counter is 3 again, and an index that had seen 3 skipped the
    reload, planning loads of gone variants and holes of stored ones. The namespace's epoch differs."""
    from cachefuse.metadata.index import VariantIndex
    from cachefuse.metadata.refresher import IndexRefresher

    before = RedisMetaStore(private_redis.url, max_variants=10, timeout_s=0.5)
    for key in "ABC":
        before.put(alone(key))
    index = VariantIndex()
    refresher = IndexRefresher(index, lambda: before, 3600)
    assert refresher.refresh_once(before) and sorted(r.chunk_key for r in index.records()) == ["A", "B", "C"]
    seen = before.generation()
    private_redis.stop()
    private_redis.start()  # empty: no persistence
    after = RedisMetaStore(private_redis.url, max_variants=10, timeout_s=0.5)  # another engine, after
    for key in "XYZ":
        after.put(alone(key))
    with private_redis.client() as raw:
        assert int(raw.get("cachefuse:meta:generation")) == 3  # the counter alone cannot tell
    assert before.generation() != seen
    assert refresher.refresh_once(before) and sorted(r.chunk_key for r in index.records()) == ["X", "Y", "Z"]


def test_record_uses_is_one_round_trip_and_survives_a_flushed_script_cache(private_redis, monkeypatch):
    """A queued Script object made redis-py send SCRIPT EXISTS before the EVALSHAs: two round trips, each a
    call's latency on a slow Redis. A server that lost its scripts (restarted, SCRIPT FLUSH) loads it again."""
    import redis as redis_py

    store = RedisMetaStore(private_redis.url, max_variants=10, timeout_s=0.5)
    ids = []
    for key in "ABCD":
        store.put(alone(key))
        ids.append(alone(key).variant_id)
    sends = []
    real = redis_py.connection.Connection.send_packed_command
    monkeypatch.setattr(redis_py.connection.Connection, "send_packed_command",
                        lambda self, command, *a, **k: sends.append(command) or real(self, command, *a, **k))
    assert store.record_uses([(v, 0.5) for v in ids]) == 4  # the script is loaded here
    sends.clear()
    assert store.record_uses([(v, 0.5) for v in ids]) == 4
    assert len(sends) == 1
    with private_redis.client() as admin:
        admin.script_flush()
    assert store.record_uses([(v, 0.5) for v in ids]) == 4
    assert [store.get(v).access_count for v in ids] == [3, 3, 3, 3]


def test_an_epoch_lost_under_running_engines_is_set_again(private_redis):
    """The epoch was only written when a process opened the namespace: a Redis restarted empty under
    running engines had none, and a second empty restart with as many saves went unnoticed."""
    store = RedisMetaStore(private_redis.url, max_variants=10, timeout_s=0.5)
    seen = []
    for life in range(3):
        for key in "ABC":
            store.put(alone(f"{key}{life}"))
        seen.append(store.generation())
        private_redis.stop()
        private_redis.start()  # empty: no persistence; the engine keeps running, nothing reopens
    assert len(set(seen)) == 3


def test_a_key_of_another_type_is_an_unreadable_row_not_a_failed_reload(private_redis):
    from cachefuse.metadata.index import VariantIndex
    from cachefuse.metadata.refresher import IndexRefresher

    store = RedisMetaStore(private_redis.url, max_variants=10, timeout_s=0.5)
    good, bad = alone("A"), alone("B")
    store.put(good)
    store.put(bad)
    with private_redis.client() as raw:
        raw.delete(f"cachefuse:meta:v:{bad.variant_id}")
        raw.set(f"cachefuse:meta:v:{bad.variant_id}", "a string, not a hash")
    assert [r.chunk_key for r in store.all_records()] == ["A"]
    assert [r.chunk_key for r in store.get_many([good.variant_id, bad.variant_id])] == ["A"]
    index = VariantIndex()
    refresher = IndexRefresher(index, lambda: store, 3600, full_interval_s=1e9)
    assert refresher.refresh_once(store) and "A" in index and "B" not in index
    store.put(alone("C"))
    assert refresher.refresh_once(store, full=False) and "C" in index


def test_a_passing_error_reply_fails_the_read_instead_of_hiding_the_row(private_redis, monkeypatch):
    """Every error reply in get_many was taken for a damaged row: one BUSY (another client's slow script)
    left a variant out of the index, remembered as unreadable until a full reload."""
    import redis as redis_py

    from cachefuse.metadata.index import VariantIndex
    from cachefuse.metadata.refresher import IndexRefresher

    store = RedisMetaStore(private_redis.url, max_variants=10, timeout_s=0.5)
    store.put(alone("A"))
    index = VariantIndex()
    refresher = IndexRefresher(index, lambda: store, 3600, full_interval_s=1e9)
    assert refresher.refresh_once(store)
    store.put(alone("B"))
    real_execute = redis_py.client.Pipeline.execute
    busy = [True]

    def execute(self, raise_on_error=True):
        replies = real_execute(self, raise_on_error)
        if busy and not raise_on_error:
            busy.clear()
            return [redis_py.exceptions.BusyLoadingError("BUSY Redis is busy running a script")] * len(replies)
        return replies

    monkeypatch.setattr(redis_py.client.Pipeline, "execute", execute)
    with pytest.raises(StoreError, match="get_many"):
        refresher.refresh_once(store)
    assert refresher.refresh_once(store) and "B" in index and store.unreadable_rows == 0


def _slip_in_before_the_put_script(writer: RedisMetaStore, meanwhile) -> None:
    """Runs `meanwhile()` (another engine's write) after `writer.put` has read the stored row, just before
    its put script runs: the window in which a merge made by the writer alone went stale."""
    script = writer._put_script

    def late(*args, **kwargs):
        meanwhile()
        return script(*args, **kwargs)

    writer._put_script = late


def test_a_reuse_recorded_during_an_upsert_is_kept(redis_url, redis_namespace):
    """An upsert merges the counters with the row as its write finds it: a reuse another engine recorded
    after this writer read the row still counts (merged from the writer's read, f_r lost it)."""
    writer = RedisMetaStore(redis_url, max_variants=10, clock=lambda: 1.0, namespace=redis_namespace)
    other = RedisMetaStore(redis_url, max_variants=10, clock=lambda: 2.0, namespace=redis_namespace)
    variant = alone("A")
    writer.put(variant)
    writer.record_use(variant.variant_id, 0.5)  # f_r 2.0, access_count 1
    _slip_in_before_the_put_script(writer, lambda: other.record_use(variant.variant_id, 0.25))  # + 4.0
    writer.put(alone("A"))  # a re-save of the same variant
    stored = writer.get(variant.variant_id)
    assert (stored.access_count, stored.f_r) == (2, 6.0)
    assert writer.variants("A")[0].f_r == 6.0  # and the eviction order uses it
    assert [r.variant_id for r in writer.all_records()] == [variant.variant_id]


def test_statistics_saved_during_a_save_without_them_are_kept(redis_url, redis_namespace):
    writer = RedisMetaStore(redis_url, max_variants=10, clock=lambda: 1.0, namespace=redis_namespace)
    other = RedisMetaStore(redis_url, max_variants=10, clock=lambda: 2.0, namespace=redis_namespace)
    with_stats = VariantRecord(chunk_key="A", prefix=("S",), inter={"S": 0.3}, intra=0.7, num_tokens=2,
                               prefix_num_tokens={"S": 4}, ranked_tokens=(1, 0), recompute_ratio=0.15)
    bare = VariantRecord.without_stats("A", ("S",), 2, {"S": 4})
    _slip_in_before_the_put_script(writer, lambda: other.put(with_stats))
    writer.put(bare)  # read: no row; written: the row the other engine saved meanwhile
    stored = writer.get(with_stats.variant_id)
    assert stored.has_stats and (stored.inter, stored.intra, stored.ranked_tokens) == ({"S": 0.3}, 0.7, (1, 0))
    assert stored.cci == with_stats.cci


def test_a_damaged_row_is_replaced_whole_even_if_its_counters_read(redis_url, redis_namespace, redis_server):
    """The writer found the row unreadable: the script merges nothing from it (choice 6), so a damaged
    statistics field cannot survive a save without statistics."""
    store = RedisMetaStore(redis_url, max_variants=10, clock=lambda: 1.0, namespace=redis_namespace)
    with_stats = VariantRecord(chunk_key="A", prefix=("S",), inter={"S": 0.3}, intra=0.7, num_tokens=2,
                               prefix_num_tokens={"S": 4})
    store.put(with_stats)
    store.record_use(with_stats.variant_id, 0.5)
    with redis_server.client() as raw:
        raw.hset(f"{redis_namespace}:meta:v:{with_stats.variant_id}", "inter", "{not json")
    store.put(VariantRecord.without_stats("A", ("S",), 2, {"S": 4}))
    stored = store.get(with_stats.variant_id)
    assert stored is not None and not stored.has_stats and stored.access_count == 0


def _with_stats(inter: float, ranked: tuple[int, ...]) -> VariantRecord:
    return VariantRecord(chunk_key="A", prefix=("S",), inter={"S": inter}, intra=0.7, num_tokens=2,
                         prefix_num_tokens={"S": 4}, ranked_tokens=ranked, recompute_ratio=0.15)


@pytest.mark.parametrize("meanwhile", ["newer_stats", "removed", "repaired"])
def test_an_upsert_lands_as_sqlite_would_whatever_happened_since_its_read(redis_url, redis_namespace,
                                                                        redis_server, meanwhile):
    """The writer read the row, then another engine changed it before the writer's script ran. SQLite merges
    inside its transaction, so its answer is the reference: the newer statistics win over the ones read,
    a removed row comes back as the new record alone, a row repaired since it was read damaged is merged."""
    writer = RedisMetaStore(redis_url, max_variants=10, clock=lambda: 1.0, namespace=redis_namespace)
    other = RedisMetaStore(redis_url, max_variants=10, clock=lambda: 2.0, namespace=redis_namespace)
    variant_id = _with_stats(0.3, (1, 0)).variant_id
    writer.put(_with_stats(0.3, (1, 0)))
    if meanwhile == "newer_stats":
        _slip_in_before_the_put_script(writer, lambda: other.put(_with_stats(0.9, (0, 1))))
        expected = ({"S": 0.9}, (0, 1), 0, 0.0)
    elif meanwhile == "removed":
        for _ in range(3):
            writer.record_use(variant_id, 0.5)
        _slip_in_before_the_put_script(writer, lambda: other.remove(variant_id))
        expected = ({"S": 0.0}, (), 0, 0.0)
    else:
        with redis_server.client() as raw:
            raw.hset(f"{redis_namespace}:meta:v:{variant_id}", "inter", "{not json")
        _slip_in_before_the_put_script(writer, lambda: (other.put(_with_stats(0.9, (0, 1))),
                                                        [other.record_use(variant_id, 0.5) for _ in range(3)]))
        expected = ({"S": 0.9}, (0, 1), 3, 6.0)
    writer.put(VariantRecord.without_stats("A", ("S",), 2, {"S": 4}))
    stored = writer.get(variant_id)
    assert (stored.inter, stored.ranked_tokens, stored.access_count, stored.f_r) == expected

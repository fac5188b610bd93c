"""A variant's origin (cachefuse/metadata/base.py, choice 9: `neighbour_fused`) in stores written before it.

Both backends' round trip is tests/metadata/test_contract.py's; here the field through the in-memory SQLite
store and the worker-to-scheduler dicts, and stores written by cachefuse before records carried it: a
meta.sqlite without the column opens (read-only too) and reads False, gaining the column when writable, and
a Redis hash without the field reads False. Rule 8's use of it is tests/metadata/test_default_variant.py's;
the neighbour step setting it tests/offline/test_neighbours.py's and tests/vllm/test_neighbour_precompute.py's.
"""

from __future__ import annotations

import sqlite3

import pytest

from cachefuse.metadata.base import VariantRecord, record_from_dict, record_to_dict
from cachefuse.metadata.index import VariantIndex, plan_variants
from cachefuse.metadata.redis import RedisMetaStore
from cachefuse.metadata.sqlite import SqliteMetaStore


def neighbour_variant(**kw) -> VariantRecord:
    return VariantRecord.without_stats("C", ("N1", "N2"), 4, neighbour_fused=True, **kw)


def loads_after_unrelated_chunks(records: list[VariantRecord]) -> tuple[str, ...]:
    """The prefix of the variant C loads after U (not its neighbour) under `default_variant: fused`."""
    index = VariantIndex([VariantRecord.without_stats(k, (), 4) for k in ("S", "U", "C")] + records)
    choice = plan_variants(index, ["S", "U", "C"], [True, False, False], [4] * 3, 1.0, default_variant="fused")[2]
    return {r.variant_id: r for r in index.records()}[choice.variant_id].prefix


def test_the_in_memory_store_and_the_worker_messages_keep_the_origin():
    with SqliteMetaStore(":memory:", max_variants=10) as store:
        store.put(neighbour_variant())
        store.put(VariantRecord.without_stats("C", ("U",), 4))
        assert {r.prefix: r.neighbour_fused for r in store.variants("C")} == {("N1", "N2"): True, ("U",): False}
    assert record_from_dict(record_to_dict(neighbour_variant())).neighbour_fused
    assert not record_from_dict(record_to_dict(VariantRecord.without_stats("C", ("U",), 4))).neighbour_fused


def test_a_record_takes_a_bool_only():
    with pytest.raises(TypeError, match="neighbour_fused"):
        VariantRecord.without_stats("C", ("N1",), 4, neighbour_fused=1)


def test_sqlite_store_written_before_the_column_reads_false_and_gains_it(tmp_path):
    """An older meta.sqlite (no neighbour_fused column) opens, read-only without adding it; its rows read as
    not neighbour-fused, so under "fused" the chunk loads its base variant; opened writable it gains the
    column, and a variant marked afterwards keeps its mark. Control: the same file with the column kept
    reads the mark, and the chunk loads the neighbour variant."""
    path = tmp_path / "meta.sqlite"
    with SqliteMetaStore(str(path), max_variants=10) as store:
        store.put(neighbour_variant())
    with SqliteMetaStore(str(path), max_variants=10) as store:  # control: the column as written
        (kept,) = store.all_records()
        assert kept.neighbour_fused and loads_after_unrelated_chunks([kept]) == ("N1", "N2")
    with sqlite3.connect(path) as conn:
        conn.execute("ALTER TABLE variants DROP COLUMN neighbour_fused")  # as cachefuse wrote it before
    with SqliteMetaStore(f"file:{path}?mode=ro", max_variants=10, uri=True) as read_only:
        (old,) = read_only.all_records()
        assert not old.neighbour_fused and read_only.unreadable_rows == 0
    with sqlite3.connect(path) as conn:  # read-only left the file as it was
        assert "neighbour_fused" not in {row[1] for row in conn.execute("PRAGMA table_info(variants)")}
    with SqliteMetaStore(str(path), max_variants=10) as store:
        (old,) = store.all_records()
        assert not old.neighbour_fused and store.unreadable_rows == 0
        assert loads_after_unrelated_chunks([old]) == ()
        store.put(VariantRecord.without_stats("D", ("N1",), 4, neighbour_fused=True))
    with SqliteMetaStore(str(path), max_variants=10) as store:
        assert {r.chunk_key: r.neighbour_fused for r in store.all_records()} == {"C": False, "D": True}


def test_redis_hash_written_before_the_field_reads_false(redis_url, redis_namespace, redis_server):
    """A variant hash without the neighbour_fused field (written before it) reads as not neighbour-fused;
    control: the field as written reads True."""
    store = RedisMetaStore(redis_url, max_variants=10, clock=lambda: 1.0, namespace=redis_namespace)
    store.put(neighbour_variant())
    variant_id = neighbour_variant().variant_id
    assert store.get(variant_id).neighbour_fused  # control
    with redis_server.client() as raw:
        assert raw.hdel(f"{redis_namespace}:meta:v:{variant_id}", "neighbour_fused") == 1
    (old,) = store.all_records()
    assert not old.neighbour_fused and not store.get(variant_id).neighbour_fused and store.unreadable_rows == 0
    assert loads_after_unrelated_chunks([old]) == ()
    store.put(neighbour_variant())  # the step marking it again
    assert store.get(variant_id).neighbour_fused
    store.close()

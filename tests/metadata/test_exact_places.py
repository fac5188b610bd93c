"""Exact places in the metadata (docs/variants.md, Exact places): the place hash, the index's choice
(metadata/index.py rule 7), admission leaving exact chunks alone, and SQLite stores written before the column.

Both backends' round trip is tests/metadata/test_contract.py's; the engine's side
tests/fusion/test_exact_places.py's.
"""

from __future__ import annotations

import sqlite3

from cachefuse.chunks import place_hash, place_hashes
from cachefuse.metadata.base import VariantRecord
from cachefuse.metadata.index import Admission, VariantIndex, plan_variants
from cachefuse.metadata.sqlite import SqliteMetaStore


def test_place_hashes_hash_exactly_the_tokens_before_each_start():
    ids = [5, 9, 2, 7, 7, 1]
    assert place_hashes(ids, [0, 2, 2, 6]) == [place_hash([]), place_hash([5, 9]), place_hash([5, 9]),
                                               place_hash(ids)]
    assert place_hash([5, 9]) != place_hash([5, 8]) and place_hash([5, 9]) != place_hash([5, 9, 0])
    assert place_hash([]) != place_hash([0])  # the length counts: a 0 token is a token


def test_the_variant_computed_at_this_place_wins_and_is_exact():
    """B's variant stored after (A,) scores CFO 0 after (A,) and would win; the one whose place matches the
    prompt's wins instead, as exact. Negative control: at another place (one token differs), the usual
    choice, not exact; and no place given (None) never finds one."""
    after_a = VariantRecord(chunk_key="B", prefix=("A",), inter={"A": 1.0}, intra=1.0, num_tokens=4,
                            prefix_num_tokens={"A": 3})
    at_place = VariantRecord.without_stats("B", ("X", "A"), 4, exact_after=place_hash([1, 2, 3]))
    index = VariantIndex([after_a, at_place])
    exact = index.choose("B", ("A",), 1.0, 4, place=place_hash([1, 2, 3]))
    assert exact.variant_id == at_place.variant_id and exact.exact and exact.cfo == 0.0
    for place in (place_hash([1, 2, 4]), None):
        usual = index.choose("B", ("A",), 1.0, 4, place=place)
        assert usual.variant_id == after_a.variant_id and not usual.exact


def test_plan_marks_exact_chunks_never_the_system_and_admits_none_of_them():
    """The most eager admission (threshold 0, no limit) computes every loaded chunk in full but the one at
    its exact place; the system chunk is never marked exact (it is exact by its key)."""
    system_ids, a_ids = [1, 2], [3, 4, 5]
    records = [VariantRecord.without_stats("S", (), 2, exact_after=place_hash([])),
               VariantRecord.without_stats("A", (), 3, exact_after=place_hash(system_ids)),
               VariantRecord.without_stats("B", (), 3, exact_after=place_hash(system_ids))]
    ids = system_ids + a_ids + [6, 7, 8]
    places = place_hashes(ids, [0, 2, 5])
    choices = plan_variants(VariantIndex(records), ["S", "A", "B"], [True, False, False], [2, 3, 3], 1.0,
                            Admission(0.0, None), places=places)
    assert [None if c is None else c.exact for c in choices] == [False, True, None]  # B: admitted
    control = plan_variants(VariantIndex(records), ["S", "A", "B"], [True, False, False], [2, 3, 3], 1.0,
                            Admission(0.0, None))  # no places: nothing is exact
    assert [None if c is None else c.exact for c in control] == [False, False, None]


def test_sqlite_store_written_before_the_column_gains_it(tmp_path):
    """An older meta.sqlite (no exact_after column) opens, its rows read as approximate, and the column is
    added so new rows keep their place; read-only (cachefuse inspect) it reads without adding it."""
    path = tmp_path / "meta.sqlite"
    with SqliteMetaStore(str(path), max_variants=10) as store:
        store.put(VariantRecord.without_stats("A", (), 3, exact_after=place_hash([1])))
    with sqlite3.connect(path) as conn:
        conn.execute("ALTER TABLE variants DROP COLUMN exact_after")  # as an older cachefuse wrote it
    with SqliteMetaStore(f"file:{path}?mode=ro", max_variants=10, uri=True) as read_only:
        (old,) = read_only.all_records()
        assert old.exact_after is None and read_only.unreadable_rows == 0
    with SqliteMetaStore(str(path), max_variants=10) as store:
        (old,) = store.all_records()
        assert old.exact_after is None
        store.put(VariantRecord.without_stats("B", (), 3, exact_after=place_hash([2])))
    with SqliteMetaStore(str(path), max_variants=10) as store:
        assert {r.chunk_key: r.exact_after for r in store.all_records()} == {"A": None, "B": place_hash([2])}

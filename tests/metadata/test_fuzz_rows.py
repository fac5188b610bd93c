"""Mutated metadata rows through both backends: 0 escaped exceptions.

Each example damages one field of one stored variant with a value of any type (what a bad disk block,
a crash or another writer leaves) and runs every call of the MetaStore contract. The damaged variant
becomes a miss; the others stay readable; only StoreError, the contract's error, may be raised.
"""

from __future__ import annotations

import json
import sqlite3
import uuid

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cachefuse.errors import StoreError
from cachefuse.metadata.sqlite import _COLUMNS
from tests.helpers.hostile import json_values
from tests.metadata.test_contract import (
    alone,
    c3_after_c1_c2,
    c3_alone,
    corrupt_row,
    open_store,  # noqa: F401  (the fixture: both backends, a fresh store per name)
)

EXAMPLES = 150  # per backend: 300 mutated rows in all
RECORDS = [alone("C1"), c3_alone(), c3_after_c1_c2()]
FIELDS = [c for c in _COLUMNS if c != "variant_id"]


def as_stored(value) -> str | int | float | bytes | None:
    """A value as a backend column or hash field can hold it (SQLite is dynamically typed)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: on disk, bytes that are not UTF-8
            return value.encode("utf-8", "surrogatepass")
        return value
    if value is None or isinstance(value, int | float | bytes) and not isinstance(value, bool):
        return value
    return json.dumps(value, default=str)


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(index=st.integers(0, len(RECORDS) - 1), field=st.sampled_from(FIELDS), value=json_values)
def test_a_mutated_row_never_escapes_the_contract(open_store, index, field, value):  # noqa: F811
    store = open_store(name=f"fuzz-{uuid.uuid4().hex[:8]}", max_variants=4)  # a fresh store per example
    for record in RECORDS:
        store.put(record)
    damaged = RECORDS[index]
    stored = as_stored(value)
    if hasattr(store, "_client") and stored is None:  # a Redis hash field holds bytes: "" for nothing
        stored = ""
    try:
        corrupt_row(store, damaged.variant_id, field, stored)
    except (sqlite3.IntegrityError, OverflowError):  # SQLite refuses it (NOT NULL, > 64 bits): no file holds it
        assume(False)
    evicted: set[str] = set()
    calls = [
        store.all_records, lambda: store.variants("C3"), lambda: store.get(damaged.variant_id),
        lambda: store.choose("C3", ("C1", "C2"), 1.0), lambda: store.record_use(damaged.variant_id, 0.5),
        lambda: store.record_uses([(r.variant_id, 0.2) for r in RECORDS]), store.count, store.size_by_tier,
        store.generation, lambda: evicted.update(r.variant_id for r in store.put(alone("C9"))),
        lambda: evicted.update(r.variant_id for r in store.put(alone("C8"))),
        lambda: store.remove(damaged.variant_id),
        lambda: evicted.update(r.variant_id for r in store.put(damaged)),
    ]
    for call in calls:
        try:
            call()
        except StoreError:
            pass  # the contract's error: the callers (worker, index refresher) catch it
    others = {r.variant_id for r in RECORDS} - {damaged.variant_id} - evicted
    assert others <= {r.variant_id for r in store.all_records()}  # one damaged row hides no other
    assert store.get(damaged.variant_id) is not None  # the last put repaired it


def test_a_deeply_nested_field_is_one_unreadable_row(open_store):  # noqa: F811
    """json.loads raises RecursionError on deep nesting, which once escaped the row parse, so one planted
    row (a shared Redis) stopped every engine's index from reloading."""
    store = open_store(name=f"deep-{uuid.uuid4().hex[:8]}", max_variants=4)
    for record in RECORDS:
        store.put(record)
    corrupt_row(store, RECORDS[2].variant_id, "prefix", "[" * 100_000 + "]" * 100_000)
    assert {r.variant_id for r in store.all_records()} == {r.variant_id for r in RECORDS[:2]}

"""Mutated stored entries through both persistent K/V tiers: 0 escaped exceptions.

Each example stores a valid entry, then damages what is stored the way a bad disk, a crash, another
writer or an attacker would (flipped bytes, cuts, appended garbage, header fields replaced with values
of any type), and reads it back through every read call. A read returns the original entry, bit for
bit, or a miss; nothing ever raises, and a mutation of tensor bytes is never served (the entry's `meta`
strings are informational, used by nothing, and not covered by the checksums).
"""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefuse.store.disk import DiskStore
from cachefuse.store.redis import RedisKVStore
from tests.helpers.hostile import json_values
from tests.helpers.store import IDENTITY, assert_same_entry, make_entry

KEY = "fz0001"
EXAMPLES = 150  # per tier: 300 mutated entries in all
ENTRY = make_entry(num_tokens=4, seed=5, meta={"origin": "fuzz"})

byte_edits = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6)
header_edits = st.lists(st.tuples(st.integers(0, 40), json_values), min_size=1, max_size=3)
mutations = st.one_of(
    st.tuples(st.just("flip"), byte_edits),
    st.tuples(st.just("cut"), st.integers(0, 10**6)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("header"), header_edits),
)


def edit_header(header: dict, edits: list) -> dict:
    """Replace values at positions of the flattened header (tensor specs and metadata alike)."""
    slots = sorted((name, field) for name, spec in header.items() for field in spec)  # a fixed order
    for position, value in edits:
        name, field = slots[position % len(slots)]
        header[name][field] = value
    return header


def mutate_bytes(data: bytes, mutation) -> bytes:
    """Flipped bytes, a cut or appended garbage (a header edit, on plain bytes, flips the first byte)."""
    kind, arg = mutation
    if kind == "cut":
        return data[: arg % max(1, len(data))]
    if kind == "append":
        return data + arg
    out = bytearray(data or b"\0")
    for position, value in (arg if kind == "flip" else [(0, 1)]):
        out[position % len(out)] ^= value or 1
    return bytes(out)


def mutate_file(data: bytes, mutation) -> bytes:
    """A safetensors file mutated as bytes, or with values of its JSON header replaced."""
    if mutation[0] != "header":
        return mutate_bytes(data, mutation)
    (header_len,) = struct.unpack("<Q", data[:8])
    header = edit_header(json.loads(data[8:8 + header_len]), mutation[1])
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data[8 + header_len:]


def check_reads(store) -> None:
    got = store.get(KEY)
    if got is not None:  # only undamaged tensors are served (`meta` is informational: no checksum covers it)
        assert_same_entry(dataclasses.replace(got, meta=ENTRY.meta), ENTRY)
    layer = store.get_layer(KEY, 1)
    if layer is not None:
        assert layer[0].shape == ENTRY.k_nope[1].shape and layer[1].shape == ENTRY.v[1].shape
    store.contains(KEY)
    assert isinstance(store.keys(), list)


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(mutation=mutations)
def test_mutated_disk_entries_are_served_intact_or_missed(tmp_path_factory, mutation):
    store = DiskStore(tmp_path_factory.mktemp("fuzz-disk"), IDENTITY, 1 << 30)
    assert store.put(KEY, ENTRY)
    path = store._path(KEY)
    path.write_bytes(mutate_file(path.read_bytes(), mutation))
    check_reads(store)
    check_reads(DiskStore(store.root, IDENTITY, 1 << 30))  # and after a restart's scan


@pytest.fixture(scope="module")
def redis_store(redis_url):
    store = RedisKVStore(redis_url, IDENTITY, namespace="fuzz-entries")
    yield store
    store.close()


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(field_index=st.integers(0, 40), mutation=mutations, drop=st.booleans())
def test_mutated_redis_entries_are_served_intact_or_missed(redis_store, redis_server, field_index, mutation, drop):
    assert redis_store.put(KEY, ENTRY)
    entry_key = f"fuzz-entries:kv:e:{KEY}"
    with redis_server.client() as raw:
        fields = raw.hgetall(entry_key)
        name = sorted(fields)[field_index % len(fields)]  # the header or one layer's K or V bytes
        if drop:
            raw.hdel(entry_key, name)
        elif name == b"header" and mutation[0] == "header":
            raw.hset(entry_key, name, json.dumps(edit_header({"h": json.loads(fields[name])}, mutation[1])["h"]))
        else:
            raw.hset(entry_key, name, mutate_bytes(fields[name], mutation))
    check_reads(redis_store)

"""RedisKVStore: layout and round trip, per-layer reads, bad data as misses, LRU budget with pins, tiering,
and a server that stops, pauses or drops connections (a bounded miss, never a hang or an exception)."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefuse.errors import ConfigError, StoreError
from cachefuse.store import entry_format
from cachefuse.store.base import ChunkKV, KVStore, StoreIdentity
from cachefuse.store.memory import MemoryStore
from cachefuse.store.redis import RedisKVStore, encode_fields
from cachefuse.store.tiered import TieredStore
from tests.helpers.redis_server import DroppingProxy, RedisServer, delete_namespace
from tests.helpers.store import IDENTITY, IDENTITY_BF16, OPS, assert_same_entry, make_entry, run_ops

KEY = "ab12cd"
HANG_GUARD_S = 5.0  # a failing call must return well within this (it is bounded by timeout_s)


def stored_size(entry: ChunkKV, identity: StoreIdentity = IDENTITY) -> int:
    return sum(len(value) for value in encode_fields(entry, identity).values())


@pytest.fixture
def raw(redis_server: RedisServer):
    """A plain client on the shared server, to read and damage what the store wrote."""
    client = redis_server.client()
    yield client
    client.close()


@pytest.fixture
def make_store(redis_url, redis_namespace):
    """`make_store(identity=IDENTITY, capacity_bytes=0)`: a store on this test's namespace."""
    stores: list[RedisKVStore] = []

    def make(identity: StoreIdentity = IDENTITY, capacity_bytes: int = 0) -> RedisKVStore:
        stores.append(RedisKVStore(redis_url, identity, capacity_bytes, namespace=redis_namespace))
        return stores[-1]

    yield make
    for store in stores:
        store.close()


# --------------------------------------------------------------------------- format and round trip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_round_trip_and_layout(make_store, raw, redis_namespace, dtype, num_tokens):
    identity = IDENTITY if dtype == torch.float32 else IDENTITY_BF16
    store = make_store(identity)
    entry = make_entry(num_tokens, dtype, meta={"prefix": "c1,c2", "variant": "base"})
    assert store.put(KEY, entry) and store.contains(KEY) and not store.contains("zz99")
    assert_same_entry(store.get(KEY), entry)
    layer = store.get_layer(KEY, 2)
    assert torch.equal(layer[0], entry.k_nope[2]) and torch.equal(layer[1], entry.v[2])

    fields = raw.hgetall(f"{redis_namespace}:kv:e:{KEY}")
    assert sorted(fields) == sorted([b"header", *(f"{kv}.{i}".encode() for kv in "kv" for i in range(3))])
    header = json.loads(fields[b"header"])
    assert header["format"] == "cachefuse-kv" and header["format_version"] == "1"
    assert header["model_fingerprint"] == "fp-test" and header["num_layers"] == "3"
    assert header["dtype"] == str(dtype).removeprefix("torch.") and header["num_tokens"] == str(num_tokens)
    assert header["checksum.v.1"] == entry_format.checksum(entry.v[1]) and header["meta.variant"] == "base"
    assert header["shape.k.0"] == f"{num_tokens},2,8" and header["shape.v.0"] == f"{num_tokens},2,6"
    assert fields[b"v.1"] == entry.v[1].contiguous().view(torch.uint8).numpy().tobytes()
    assert all(key.decode().startswith(f"{redis_namespace}:kv:") for key in raw.keys(f"{redis_namespace}:*"))
    assert store.nbytes == stored_size(entry, identity) == store.stats.bytes_written
    assert store.keys() == [KEY] and store.stats.hits == 2

    other = make_store(identity)  # another instance on the same namespace sees it
    assert other.contains(KEY) and other.keys() == [KEY]
    assert_same_entry(other.get(KEY), entry)


def test_stored_and_given_tensors_are_never_mutated(make_store):
    store = make_store()
    entry = make_entry(11)
    before = ChunkKV([t.clone() for t in entry.k_nope], [t.clone() for t in entry.v], dict(entry.meta))
    store.put(KEY, entry)
    assert_same_entry(entry, before)  # put only reads what it is given
    got = store.get(KEY)
    got.k_nope[0].mul_(2.0)
    got.v[1].add_(1.0)
    layer_k, _ = store.get_layer(KEY, 0)
    layer_k.zero_()
    assert_same_entry(store.get(KEY), before)
    entry.v[0].add_(1.0)  # the caller's tensors after put are the caller's
    assert_same_entry(store.get(KEY), before)


def test_replace_remove_and_aliased_tensors(make_store):
    store = make_store()
    shared_k, shared_v = torch.randn(4, 2, 8), torch.randn(4, 2, 6)
    one_for_all = ChunkKV([shared_k] * 3, [shared_v] * 3)
    assert store.put(KEY, make_entry(5)) and store.put(KEY, one_for_all)
    assert_same_entry(store.get(KEY), one_for_all)
    assert store.nbytes == stored_size(one_for_all) and store.keys() == [KEY]
    store.remove(KEY)
    store.remove(KEY)
    assert store.get(KEY) is None and not store.contains(KEY) and store.nbytes == 0 and store.keys() == []
    assert store.stats.misses == {"absent": 1}


def test_bad_keys_raise_and_foreign_puts_fail(make_store):
    store = make_store()
    for key in ["../x", "a", "ab:cd", ""]:
        with pytest.raises(StoreError):
            store.put(key, make_entry(5))
    assert not store.put(KEY, make_entry(5, num_layers=2))
    assert not store.put(KEY, make_entry(5, torch.bfloat16))
    assert store.stats.put_failures == 2 and not store.contains(KEY)
    with pytest.raises(ConfigError):
        RedisKVStore("http://localhost:1", IDENTITY)
    with pytest.raises(ConfigError):
        RedisKVStore("redis://localhost:1", IDENTITY, -1)
    assert isinstance(store, KVStore)


# --------------------------------------------------------------------------- bad data


def _entry_key(namespace: str) -> str:
    return f"{namespace}:kv:e:{KEY}"


def _set_field(field: str, value: bytes):
    return lambda client, key: client.hset(key, field, value)


def _cut_field(field: str, keep: int):
    return lambda client, key: client.hset(key, field, client.hget(key, field)[:keep])


def _flip_byte(client, key):
    raw = bytearray(client.hget(key, "k.1"))
    raw[3] ^= 0xFF
    client.hset(key, "k.1", bytes(raw))


def _edit_header(**changes):
    def edit(client, key):
        header = json.loads(client.hget(key, "header"))
        header.update(changes)
        client.hset(key, "header", json.dumps(header))

    return edit


def _write_as(identity: StoreIdentity, num_layers: int = 3, dtype=torch.float32):
    def write(client, key):
        client.delete(key)
        client.hset(key, mapping=encode_fields(make_entry(5, dtype, num_layers=num_layers), identity))

    return write


@pytest.mark.parametrize(
    "damage, reason",
    [
        (_flip_byte, "corrupt"),
        (_cut_field("v.2", 10), "truncated"),
        (_set_field("v.2", b""), "truncated"),
        (lambda client, key: client.hset(key, "k.0", client.hget(key, "k.0") + b"xx"), "corrupt"),
        (lambda client, key: client.hdel(key, "v.1"), "corrupt"),
        (lambda client, key: client.hdel(key, "header"), "corrupt"),
        (_cut_field("header", 40), "truncated"),
        (_set_field("header", b""), "truncated"),
        (_set_field("header", b"\xff\xfe garbage \x00"), "corrupt"),
        (_set_field("header", b"[1, 2, 3]"), "corrupt"),
        # a valid header padded past the cap: not parsed (a crafted one would take ~23x its size to parse)
        (lambda client, key: client.hset(key, "header", client.hget(key, "header") + b" " * (16 << 20)), "corrupt"),
        (_set_field("header", b"[" * 100_000 + b"]" * 100_000), "corrupt"),  # nested past the parser's depth
        (_edit_header(**{"shape.k.1": "five"}), "corrupt"),
        (_edit_header(**{"shape.k.1": "5,2,16"}), "truncated"),
        (_edit_header(**{"shape.k.1": "5,16"}), "shape_mismatch"),
        (_edit_header(num_tokens="4"), "shape_mismatch"),
        (_edit_header(num_tokens="many"), "corrupt"),
        (_edit_header(format_version="2"), "foreign_model"),
        (lambda client, key: (client.delete(key), client.set(key, b"garbage")), "corrupt"),
        (_write_as(StoreIdentity("other-model", 3, torch.float32)), "foreign_model"),
        (_write_as(IDENTITY_BF16, dtype=torch.bfloat16), "foreign_model"),
        (_write_as(StoreIdentity("fp-test", 4, torch.float32), num_layers=4), "shape_mismatch"),
        (lambda client, key: client.delete(key), "absent"),
    ],
    ids=["flipped", "truncated-field", "empty-field", "overlong-field", "missing-field", "no-header",
         "truncated-header", "empty-header", "garbage-header", "header-not-object", "huge-header", "deep-header",
         "bad-shape", "long-shape",
         "2d-shape", "num-tokens", "num-tokens-garbage", "format-version", "wrong-redis-type",
         "fingerprint", "dtype", "layers", "deleted"],
)
def test_bad_entries_are_counted_misses_and_dropped(make_store, raw, redis_namespace, damage, reason):
    store = make_store()
    store.put(KEY, make_entry(5))
    damage(raw, _entry_key(redis_namespace))
    assert store.get(KEY) is None
    assert store.stats.misses == {reason: 1}
    assert not store.contains(KEY) and raw.exists(_entry_key(redis_namespace)) == 0  # bad entries go
    assert store.keys() == [] and store.nbytes == 0  # and leave the index
    assert store.get(KEY) is None and store.stats.misses.get("absent", 0) == 1 + (reason == "absent")
    assert store.put(KEY, make_entry(5, seed=3))
    assert_same_entry(store.get(KEY), make_entry(5, seed=3))


@pytest.mark.parametrize("field", ["k.1", "header"])
def test_a_field_longer_than_its_whole_entry_is_dropped_before_it_is_sent(make_store, raw, redis_namespace,
                                                                         caplog, monkeypatch, field):
    """Written around the put script (another writer, a bit flip in a length), a field longer than the
    entry's recorded size, the header included, is dropped by the read script from its length alone: no
    byte of it crosses the network (a reply of hundreds of MiB timed out as an io_error on every read and
    was never dropped)."""
    store = make_store()
    store.put(KEY, make_entry(5))
    size = stored_size(make_entry(5))
    entry_key = _entry_key(redis_namespace)
    if field == "k.1":
        assert store.get_layer(KEY, 0) is not None  # sound until then, and read as such
    raw.hset(entry_key, field, b"\0" * (size + 1))
    replies = []
    read = store._read
    monkeypatch.setattr(store, "_read", lambda **kw: replies.append(read(**kw)) or replies[-1])
    with caplog.at_level("WARNING", logger="cachefuse.store.redis"):
        assert store.get_layer(KEY, 1) is None
    assert f"field {field} of {size + 1} bytes, over the {size}" in caplog.text
    assert sum(len(part) for part in replies[0] if isinstance(part, bytes)) < 100  # nothing of it was sent
    assert store.stats.misses == {"corrupt": 1}
    assert raw.exists(entry_key) == 0 and store.keys() == [] and store.nbytes == 0


def test_a_field_within_its_entry_size_is_still_read_and_checked(make_store, raw, redis_namespace, caplog):
    """The length bound only refuses what cannot be an entry's field; a field that fits is read and its
    shape check finds it (the negative control: the script's bound is not what catches this one)."""
    store = make_store()
    store.put(KEY, make_entry(5))
    raw.hset(_entry_key(redis_namespace), "k.1", raw.hget(_entry_key(redis_namespace), "k.1") + b"xx")
    with caplog.at_level("WARNING", logger="cachefuse.store.redis"):
        assert store.get_layer(KEY, 1) is None
    assert "over the" not in caplog.text and "shape" in caplog.text
    assert store.stats.misses == {"corrupt": 1}


def test_get_layer_verifies_only_the_layer_it_reads(make_store, raw, redis_namespace):
    store = make_store()
    entry = make_entry(5)
    store.put(KEY, entry)
    _flip_byte(raw, _entry_key(redis_namespace))  # one byte of layer 1's K
    k0, v0 = store.get_layer(KEY, 0)
    assert torch.equal(k0, entry.k_nope[0]) and torch.equal(v0, entry.v[0])
    assert store.get_layer(KEY, 1) is None and store.stats.misses == {"corrupt": 1}
    with pytest.raises(IndexError):
        store.get_layer(KEY, 3)


def test_a_bad_entry_replaced_meanwhile_is_kept(make_store, raw, redis_namespace):
    store = make_store()
    store.put(KEY, make_entry(5))
    _flip_byte(raw, _entry_key(redis_namespace))
    good = encode_fields(make_entry(5, seed=7), IDENTITY)
    original_drop = store._drop

    def put_between(keys, args):  # another instance rewrites the entry between our read and our drop
        raw.hset(_entry_key(redis_namespace), mapping=good)
        return original_drop(keys=keys, args=args)

    store._drop = put_between
    assert store.get(KEY) is None and store.stats.misses == {"corrupt": 1}
    store._drop = original_drop
    assert_same_entry(store.get(KEY), make_entry(5, seed=7))


# --------------------------------------------------------------------------- budget, LRU, pins


def test_lru_budget_evicts_across_instances(make_store):
    size = stored_size(make_entry(5))
    store = make_store(capacity_bytes=3 * size)
    for i, key in enumerate(["aa01", "aa02", "aa03"]):
        assert store.put(key, make_entry(5, seed=i))
    other = make_store(capacity_bytes=3 * size)  # the LRU order and the budget are shared
    assert other.get("aa01") is not None  # aa02 becomes the least recently used
    assert store.keys() == ["aa02", "aa03", "aa01"]
    assert store.put("aa04", make_entry(5, seed=4))
    assert store.keys() == ["aa03", "aa01", "aa04"] and store.stats.evictions == 1
    assert not other.contains("aa02") and store.nbytes == 3 * size
    assert store.get_layer("aa03", 0) is not None and store.keys()[-1] == "aa03"  # get_layer is a use


def test_pins_nest_and_block_eviction(make_store):
    store = make_store(capacity_bytes=2 * stored_size(make_entry(5)))
    store.put("aa01", make_entry(5, seed=1))
    store.pin("aa01")
    store.pin("aa01")
    store.unpin("aa01")
    for i in range(2, 5):
        assert store.put(f"aa0{i}", make_entry(5, seed=i))
    assert store.contains("aa01")
    with store.pinned(["aa04"]):
        assert not store.put("aa05", make_entry(5, seed=5))  # both resident entries are pinned
    assert_same_entry(store.get("aa04"), make_entry(5, seed=4))  # a refused put leaves what was there
    store.unpin("aa01")
    assert store.put("aa05", make_entry(5, seed=5)) and not store.contains("aa01")
    assert not store.put("aa06", make_entry(40))  # larger than the whole capacity
    assert store.stats.put_failures == 2 and store.nbytes <= store.capacity_bytes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(ops=OPS, capacity=st.sampled_from([2000, 3500, 6000]))
def test_matches_reference_model(redis_url, raw, ops, capacity):
    namespace = f"test-{uuid.uuid4().hex[:12]}"
    store = RedisKVStore(redis_url, IDENTITY, capacity, namespace=namespace)
    try:
        run_ops(store, ops, size_of=stored_size)
    finally:
        store.close()
        delete_namespace(raw, namespace)


def test_tiered_memory_over_redis(make_store):
    redis_tier = make_store()
    store = TieredStore([MemoryStore(IDENTITY, 1 << 20), redis_tier])
    entry = make_entry(9, meta={"prefix": "x"})
    assert store.put(KEY, entry) and redis_tier.contains(KEY)
    assert_same_entry(store.get(KEY), entry) and store.last_hit_tier == "memory"
    fresh = TieredStore([MemoryStore(IDENTITY, 1 << 20), make_store()])  # another instance's view
    assert_same_entry(fresh.get(KEY), entry) and fresh.last_hit_tier == "redis"
    assert fresh.tiers[0].contains(KEY)  # promoted
    assert fresh.get("zz99") is None and fresh.keys() == [KEY]


# --------------------------------------------------------------------------- failures


def _assert_fails_fast(store: RedisKVStore, recorded: int) -> None:
    """Every call answers a miss / False within the hang guard; `recorded` io_error misses before."""
    start = time.monotonic()
    assert store.get(KEY) is None
    assert store.get_layer(KEY, 1) is None
    assert not store.contains(KEY)
    assert not store.put("bb02", make_entry(3))
    assert store.keys() == [] and store.nbytes == 0
    store.remove(KEY)  # logged, never raised
    assert time.monotonic() - start < HANG_GUARD_S
    assert store.stats.misses == {"io_error": recorded + 2}


def test_stopped_server_is_a_bounded_miss_then_recovers(private_redis):
    store = RedisKVStore(private_redis.url, IDENTITY, timeout_s=0.2, namespace="t")
    assert store.put(KEY, make_entry(5))
    private_redis.stop()
    _assert_fails_fast(store, 0)
    assert store.stats.put_failures == 1
    private_redis.start()  # the same port, empty (no persistence)
    assert store.get(KEY) is None and store.stats.misses["absent"] == 1
    assert store.put(KEY, make_entry(5, seed=2))
    assert_same_entry(store.get(KEY), make_entry(5, seed=2))


def test_paused_server_is_a_bounded_miss_then_recovers(private_redis, caplog):
    """A server that does not answer (frozen, or across a partition) costs two socket timeouts, not one per
    call: once a second timeout comes a whole timeout after the first with no answer between, calls are
    not sent for `outage_backoff_s` and fail at once (16 chunks had cost 16 timeouts per request, up to
    the load budget). Then the next call is sent, and the store recovers. Timeouts of one stall (a busy
    server; several threads at once) start no backoff."""
    now = [0.0]
    store = RedisKVStore(private_redis.url, IDENTITY, timeout_s=0.2, namespace="t", clock=lambda: now[0])
    assert store.put(KEY, make_entry(5))
    with private_redis.frozen():
        assert store.get(KEY) is None  # one timeout ...
        assert store.get_layer(KEY, 0) is None  # ... and another at the same moment (another thread's): a stall
    assert_same_entry(store.get(KEY), make_entry(5))  # then an answer: no backoff
    with private_redis.frozen(), caplog.at_level("DEBUG", logger="cachefuse.store.redis"):
        start = time.monotonic()
        assert store.get(KEY) is None
        now[0] += 0.2  # a whole socket timeout later, still no answer: the backoff starts
        assert store.get_layer(KEY, 0) is None
        assert not store.put("bb02", make_entry(3)) and not store.contains(KEY)
        assert time.monotonic() - start < HANG_GUARD_S
    skipped = [r for r in caplog.records if "treating as a miss" in r.getMessage() and "_Skipped" in r.getMessage()]
    assert len(skipped) == 2  # the two calls after them, not sent
    assert store.stats.misses == {"io_error": 4} and store.stats.put_failures == 1
    assert store.get(KEY) is None  # unfrozen, but still within the backoff: not sent
    now[0] += store._outage.backoff_s
    assert_same_entry(store.get(KEY), make_entry(5))  # sent again: the entry was kept


@pytest.mark.parametrize("mode", ["close", "reset"])
def test_dropped_connections_are_a_miss_then_recover(private_redis, mode):
    with DroppingProxy(private_redis.port) as proxy:
        store = RedisKVStore(proxy.url(), IDENTITY, timeout_s=0.5, namespace="t")
        assert store.put(KEY, make_entry(5)) and store.get(KEY) is not None  # a pooled connection is open
        proxy.set_mode(mode)
        _assert_fails_fast(store, 0)
        proxy.set_mode("forward")
        assert_same_entry(store.get(KEY), make_entry(5))
        assert store.put("bb02", make_entry(3)) and store.contains("bb02")


def test_password_in_url():
    with RedisServer(password="s3cret") as server:
        store = RedisKVStore(server.url, IDENTITY, namespace="t")
        assert store.put(KEY, make_entry(5)) and store.get(KEY) is not None
        start = time.monotonic()
        wrong = RedisKVStore(server.url.replace("s3cret", "nope"), IDENTITY, namespace="t")
        assert wrong.get(KEY) is None and wrong.stats.misses == {"io_error": 1}  # refused, not retried
        assert time.monotonic() - start < HANG_GUARD_S


@pytest.mark.parametrize("damage", [
    lambda raw, ns: raw.set(f"{ns}:kv:nbytes", b"not a number"),
    lambda raw, ns: raw.set(f"{ns}:kv:lru", b"a string, not a sorted set"),
    lambda raw, ns: raw.zadd(f"{ns}:kv:lru", {b"\xff\xfe not utf-8": 1.0}),
    lambda raw, ns: raw.delete(f"{ns}:kv:sizes") + raw.rpush(f"{ns}:kv:sizes", b"a list, not a hash"),
    lambda raw, ns: raw.set(f"{ns}:kv:clock", b"xyz"),
    lambda raw, ns: raw.set(f"{ns}:kv:e:{KEY}", b"a string where a hash belongs"),
])
def test_bookkeeping_keys_of_the_wrong_type_are_misses_not_exceptions(make_store, raw, redis_namespace, damage):
    """Another client (or a bug) wrote garbage into our namespace: every call still answers, as a miss
    or a failed put, and never raises into the worker."""
    store = make_store()
    assert store.put("other1", make_entry(seed=3))
    damage(raw, redis_namespace)
    store.put(KEY, make_entry(seed=4))
    store.get(KEY)
    store.get_layer(KEY, 0)
    store.contains(KEY)
    assert isinstance(store.keys(), list)
    assert isinstance(store.nbytes, int)
    store.remove(KEY)
    store.remove("other1")


@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-lfu", "allkeys-random", "volatile-lru", "noeviction"])
def test_a_server_that_evicts_any_key_when_full_is_refused_at_start(private_redis, policy):
    """Under allkeys-* Redis evicted the tiers' bookkeeping keys (byte count, LRU order, generation) along
    with entries once full, and the byte budget broke for good; entries have no TTL, so volatile-* and
    noeviction never evict them."""
    from cachefuse.errors import ConfigError
    from cachefuse.metadata.redis import RedisMetaStore

    with private_redis.client() as admin:
        admin.config_set("maxmemory", 64 << 20)
        admin.config_set("maxmemory-policy", policy)
    if policy.startswith("allkeys-"):  # the metadata store refuses it for both (one redis_url, one server)
        with pytest.raises(ConfigError, match=f"maxmemory-policy is {policy}.*noeviction"):
            RedisMetaStore(private_redis.url, max_variants=10, timeout_s=0.5)
    else:
        RedisMetaStore(private_redis.url, max_variants=10, timeout_s=0.5).close()
    # `cachefuse inspect` only reads: it reports on such a store all the same
    RedisMetaStore(private_redis.url, max_variants=10, timeout_s=0.5, read_only=True).close()
    with private_redis.client() as admin:  # no maxmemory: an allkeys policy never runs
        admin.config_set("maxmemory", 0)
    RedisMetaStore(private_redis.url, max_variants=10, timeout_s=0.5).close()

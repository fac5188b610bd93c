"""Frequency placement over memory-over-disk: hot chunks are promoted into memory, cold ones leave
it (disk keeps them); with the policy on, a disk hit alone no longer promotes."""

from cachefuse.loading.placement import FrequencyPlacement
from cachefuse.store.entry_format import encode_entry
from cachefuse.store.tiered import TieredStore, open_store
from tests.helpers.store import IDENTITY, make_entry


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_store(tmp_path) -> TieredStore:
    store = open_store(tmp_path, IDENTITY, memory_capacity_bytes=1 << 20, disk_capacity_bytes=1 << 20)
    store.promote_on_hit = False
    return store


def test_hot_key_is_promoted_and_cold_key_demoted(tmp_path):
    store = make_store(tmp_path)
    memory, disk = store.tiers
    for i, key in enumerate(("hot01", "cold1")):
        disk.put(key, make_entry(7, seed=i))
    memory.put("cold1", make_entry(7, seed=1))
    clock = FakeClock()
    policy = FrequencyPlacement(store, hot=3.0, cold=0.5, half_life_s=10.0, clock=clock)
    for _ in range(4):
        assert store.get("hot01") is not None
        policy.record(["hot01"])
    assert not memory.contains("hot01")  # served from disk, not promoted on hit
    policy.record(["cold1"])
    clock.now = 30.0  # three half-lives: cold1 decays to 0.125, hot01 to 0.5
    assert policy.apply() == [("cold1", "memory", "disk")]
    assert not memory.contains("cold1") and disk.contains("cold1")
    for _ in range(3):
        policy.record(["hot01"])
    assert policy.apply() == [("hot01", "disk", "memory")]
    assert memory.contains("hot01") and store.get("hot01") is not None and store.last_hit_tier == "memory"


def test_demoting_the_only_copy_writes_it_below_first(tmp_path):
    store = make_store(tmp_path)
    memory, disk = store.tiers
    memory.put("only1", make_entry(5))
    clock = FakeClock()
    policy = FrequencyPlacement(store, hot=3.0, cold=0.5, half_life_s=1.0, clock=clock)
    policy.record(["only1"])
    clock.now = 10.0
    assert policy.apply() == [("only1", "memory", "disk")]
    assert disk.contains("only1") and not memory.contains("only1")


def test_evicted_keys_are_forgotten(tmp_path):
    store = make_store(tmp_path)
    clock = FakeClock()
    policy = FrequencyPlacement(store, hot=3.0, cold=0.5, half_life_s=1.0, clock=clock)
    policy.record(["gone1"])
    assert policy.apply() == [] and "gone1" in policy._known  # neither hot nor cold: not looked up yet
    clock.now = 2.0  # cold: looked up, found nowhere
    assert policy.apply() == [] and "gone1" not in policy._known


def test_default_store_still_promotes_on_hit(tmp_path):
    store = open_store(tmp_path, IDENTITY, memory_capacity_bytes=1 << 20, disk_capacity_bytes=1 << 20)
    memory, disk = store.tiers
    disk.put("key01", make_entry(3))
    assert store.get("key01") is not None and memory.contains("key01")


def test_apply_looks_up_only_keys_that_could_move_and_forgets_settled_cold_ones(tmp_path):
    """Each apply runs after a blend, on the forward path, and a lookup may be a Redis round trip: keys
    between cold and hot are not looked up, and a cold key already in the slowest tier is forgotten, so
    the work per call does not grow with every key ever loaded."""
    store = make_store(tmp_path)
    memory, disk = store.tiers
    lookups = []
    for tier in (memory, disk):
        contains = tier.contains
        tier.contains = lambda key, contains=contains, name=tier.name: lookups.append((name, key)) or contains(key)
    clock = FakeClock()
    policy = FrequencyPlacement(store, hot=3.0, cold=0.5, half_life_s=10.0, clock=clock)
    for i in range(100):
        disk.put(f"c{i:04x}", make_entry(3, seed=i))
    policy.record(f"c{i:04x}" for i in range(100))
    assert policy.apply() == [] and lookups == []  # frequency 1: neither hot nor cold
    clock.now = 100.0  # ten half-lives: all cold, on disk already
    assert policy.apply() == []
    assert len(lookups) == 2 * policy.MAX_LOOKUPS and len(policy._known) == 100 - policy.MAX_LOOKUPS
    lookups.clear()
    policy.apply()
    assert not policy._known and len(lookups) == 2 * (100 - policy.MAX_LOOKUPS)
    lookups.clear()
    assert policy.apply() == [] and lookups == []  # settled: nothing looked up again


def test_more_hot_entries_than_room_do_not_evict_each_other_every_call(tmp_path):
    """Promotion goes into free room only: with four hot entries and room for two, each copy had evicted
    another hot entry (the memory tier's LRU), and every apply re-read whole entries from disk."""
    size = len(encode_entry(make_entry(7), IDENTITY))  # a disk file's bytes: what the plan is asked for
    store = open_store(tmp_path, IDENTITY, memory_capacity_bytes=2 * size, disk_capacity_bytes=1 << 20)
    store.promote_on_hit = False
    memory, disk = store.tiers
    keys = [f"hot{i:02d}" for i in range(4)]
    for i, key in enumerate(keys):
        disk.put(key, make_entry(7, seed=i))
    clock = FakeClock()
    policy = FrequencyPlacement(store, hot=3.0, cold=0.5, half_life_s=1e9, clock=clock)
    moved, reads = [], []
    get = disk.get
    disk.get = lambda key: reads.append(key) or get(key)
    for _ in range(6):
        policy.record(keys * 4)
        moved.append(len(policy.apply()))
    assert moved == [2, 0, 0, 0, 0, 0] and sum(memory.contains(k) for k in keys) == 2
    assert len(reads) == 2  # a refused promotion reads nothing


def test_a_memory_tier_filled_by_saves_still_takes_a_hot_entry(tmp_path):
    """Saves write through to memory, which stays full: the entries they left, never read since, are cold
    and make room for a hot one (a free-room-only rule had stopped promotions for good)."""
    size = make_entry(7).nbytes
    store = open_store(tmp_path, IDENTITY, memory_capacity_bytes=3 * size, disk_capacity_bytes=1 << 20)
    store.promote_on_hit = False
    memory, disk = store.tiers
    for i in range(6):
        assert store.put(f"save{i:02d}", make_entry(7, seed=i))  # through to both tiers
    disk.put("hot001", make_entry(7, seed=99))
    assert memory.nbytes == 3 * size and not memory.contains("hot001")
    policy = FrequencyPlacement(store, hot=3.0, cold=0.5, half_life_s=1e9, clock=FakeClock())
    policy.record(["hot001"] * 4)
    assert policy.apply() == [("hot001", "disk", "memory")] and memory.contains("hot001")


def test_hot_keys_already_at_the_top_do_not_starve_the_others_of_lookups(tmp_path):
    """More than MAX_LOOKUPS hot keys already in memory took every lookup of every apply: a cold key in
    memory was never demoted and a newly hot key on disk never promoted."""
    size = len(encode_entry(make_entry(3), IDENTITY))
    count = FrequencyPlacement.MAX_LOOKUPS + 10
    store = open_store(tmp_path, IDENTITY, memory_capacity_bytes=(count + 1) * size, disk_capacity_bytes=1 << 22)
    store.promote_on_hit = False
    memory, disk = store.tiers
    hot = [f"h{i:04x}" for i in range(count)]
    for i, key in enumerate(hot):
        memory.put(key, make_entry(3, seed=i))
    memory.put("cold1", make_entry(3, seed=998))
    disk.put("new01", make_entry(3, seed=999))
    clock = FakeClock()
    policy = FrequencyPlacement(store, hot=3.0, cold=0.5, half_life_s=10.0, clock=clock)
    policy.record(["cold1"])
    clock.now = 40.0  # cold1 decays to 1/16
    moves = []
    for _ in range(4):
        policy.record(hot * 4 + ["new01"] * 4)
        moves += policy.apply()
    assert ("cold1", "memory", "disk") in moves and ("new01", "disk", "memory") in moves
    assert not memory.contains("cold1") and memory.contains("new01")


def test_a_hot_entry_that_fits_in_the_free_room_is_promoted_beside_a_large_hot_one(tmp_path):
    """The check asks the target's own eviction plan with the entry's size: a small hot entry fits in the
    room beside a large hot resident (a check by average entry size had refused it on every call)."""
    small = len(encode_entry(make_entry(3), IDENTITY))
    large = make_entry(40).nbytes
    store = open_store(tmp_path, IDENTITY, memory_capacity_bytes=large + small, disk_capacity_bytes=1 << 22)
    store.promote_on_hit = False
    memory, disk = store.tiers
    memory.put("big001", make_entry(40, seed=1))
    disk.put("hot002", make_entry(3, seed=2))
    policy = FrequencyPlacement(store, hot=3.0, cold=0.5, half_life_s=1e9, clock=FakeClock())
    policy.record(["big001", "hot002"] * 4)
    assert policy.apply() == [("hot002", "disk", "memory")]
    assert memory.contains("big001") and memory.contains("hot002")


def test_promotions_out_of_redis_are_checked_like_the_others(redis_url, redis_namespace, tmp_path):
    """Redis gives an entry's stored size too, so a promotion from Redis into a full disk tier that would
    evict a hot entry is refused (without a size the check was skipped and copies evicted each other)."""
    from cachefuse.store.disk import DiskStore
    from cachefuse.store.redis import RedisKVStore
    from cachefuse.store.tiered import TieredStore

    size = len(encode_entry(make_entry(7), IDENTITY))
    redis_tier = RedisKVStore(redis_url, IDENTITY, namespace=redis_namespace)
    disk_tier = DiskStore(tmp_path, IDENTITY, 2 * size)
    store = TieredStore([disk_tier, redis_tier], promote_on_hit=False)
    keys = [f"hot{i:02d}" for i in range(4)]
    for i, key in enumerate(keys):
        redis_tier.put(key, make_entry(7, seed=i))
    assert redis_tier.size_of(keys[0]) > make_entry(7).nbytes and redis_tier.size_of("absent") is None
    policy = FrequencyPlacement(store, hot=3.0, cold=0.5, half_life_s=1e9, clock=FakeClock())
    moved = []
    for _ in range(5):
        policy.record(keys * 4)
        moved.append(len(policy.apply()))
    assert moved == [2, 0, 0, 0, 0] and disk_tier.stats.evictions == 0
    redis_tier.close()

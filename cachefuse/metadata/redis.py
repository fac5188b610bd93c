"""Variant metadata in Redis, shared by several vLLM instances: cachefuse.metadata.base's contract.

Imports the standard library, redis, `cachefuse.{metadata.base, metadata.scores, redis_client, errors}`;
no torch (the scheduler reads it). Every choice of base.py's docstring (1-7) holds exactly as in
`SqliteMetaStore`; tests/metadata/test_contract.py runs one suite over both. Layout, every key under `{namespace}:meta:`:

    v:{variant_id}     hash: the VariantRecord's fields (JSON for prefix, inter, prefix_num_tokens,
                       ranked_tokens; floats as repr, which round-trips) and `seq`, its insertion number
    chunk:{chunk_key}  zset: the chunk's variant ids, scored by seq (insertion order)
    seq                zset: every variant id by seq (count, all_records)
    by_f_r             zset: id -> f_r         } the primary eviction key of each policy; ties are
    by_last_access     zset: id -> last_access } broken in the script by (the other one, seq)
    next_seq, generation, schema_version: counters / the layout version

Atomicity: put (with its evictions), record_use and remove are each one Lua script, so concurrent
processes never interleave inside them and every record_use counts. The script adds f_r in double
precision and writes it with %.17g, so f_r equals SqliteMetaStore's to the bit. The scripts derive key
names from the namespace, so they need standalone Redis (or one shard), not Redis Cluster.

Pins live in this process's memory (choice 4) and are passed to the put script: a variant pinned here is
never evicted by a put from here; another instance does not see our pins (it may evict a variant we are
loading, whose K/V read then misses and the request falls back to recompute).

Errors: unlike the K/V tier, every method that talks to Redis raises `StoreError` on a network error or
timeout (a Redis error of any kind), reads included (get, variants, choose, all_records, count,
generation, size_by_tier, pin): the callers (the worker, the scheduler's background index refresher)
catch it. The constructor talks to Redis once, to check the layout version: another version raises
StoreError; an unreachable Redis is logged and the check is made again by the first call that gets
through, so an engine starts while Redis is down and uses it once it answers. A
variant hash that does not parse (damaged, or written by something else) is a miss, as in the SQLite
backend: skipped with a warning by the list reads (variants, all_records, a put's victims) so one bad
hash cannot hide the rest, None from `get`, `record_use` and `remove`, and counted in `unreadable_rows`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence

import redis

from cachefuse.errors import ConfigError, StoreError
from cachefuse.metadata import scores
from cachefuse.metadata.base import POLICIES, PinCounts, VariantRecord
from cachefuse.redis_client import OutageBackoff, check_eviction_policy, redis_client

logger = logging.getLogger(__name__)

SCHEMA_VERSION = "1"
_WRITES = frozenset({"put", "record_use", "remove"})
"""Operations a read-only store (`cachefuse inspect`) refuses."""

# Shared by the scripts below: drop one variant from every index, returning its fields.
_LUA_DROP = """
local function drop(p, id)
  local key = p .. 'v:' .. id
  local fields = redis.call('HGETALL', key)
  local chunk = redis.call('HGET', key, 'chunk_key')
  redis.call('DEL', key)
  redis.call('ZREM', p .. 'seq', id)
  redis.call('ZREM', p .. 'by_f_r', id)
  redis.call('ZREM', p .. 'by_last_access', id)
  redis.call('ZREM', p .. 'by_rev', id)
  if chunk then redis.call('ZREM', p .. 'chunk:' .. chunk, id) end
  return fields
end
"""

# ARGV: prefix, max_variants, policy, variant_id, chunk_key, last_access, n, damaged (the by_rev revision
# of a row the caller read and found damaged, '-' if it had none; '' otherwise), n field/value args of the
# new record as given, then the ids pinned in this process.
# Returns {'ok', victim fields...} or {'full', count, unpinned}.
# An upsert merges here, with the row as the write finds it (base.merged_upsert: the larger access_count
# and f_r, the stored statistics when the new record has none), so a reuse or a save another engine made
# after the caller read the row is kept; a row that was removed meanwhile is written as new. A damaged row
# is replaced whole only while it is the revision the caller read: repaired meanwhile, it is merged.
_LUA_PUT = _LUA_DROP + """
local p, max, policy, id, chunk = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local last, nf, damaged = ARGV[6], tonumber(ARGV[7]), ARGV[8]
local key = p .. 'v:' .. id
local exists = redis.call('EXISTS', key) == 1
local out = {'ok'}
if not exists then
  local need = redis.call('ZCARD', p .. 'seq') + 1 - max
  if need > 0 then
    local pinned = {}
    for i = 9 + nf, #ARGV do pinned[ARGV[i]] = true end
    local primary = policy == 'f_r' and 'by_f_r' or 'by_last_access'
    local secondary = policy == 'f_r' and 'last_access' or 'f_r'
    local victims, lo = {}, '-inf'
    while #victims < need do  -- walk the primary order one group of equal scores at a time
      local first = redis.call('ZRANGEBYSCORE', p .. primary, lo, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
      if #first == 0 then break end
      local rows = {}
      for _, other in ipairs(redis.call('ZRANGEBYSCORE', p .. primary, first[2], first[2])) do
        local f = redis.call('HMGET', p .. 'v:' .. other, secondary, 'seq')
        rows[#rows + 1] = {other, tonumber(f[1]) or 0, tonumber(f[2]) or 0}  -- damaged fields sort first
      end
      table.sort(rows, function(a, b) if a[2] ~= b[2] then return a[2] < b[2] end return a[3] < b[3] end)
      for _, row in ipairs(rows) do
        if #victims < need and not pinned[row[1]] then victims[#victims + 1] = row[1] end
      end
      lo = '(' .. first[2]
    end
    if #victims < need then return {'full', redis.call('ZCARD', p .. 'seq'), #victims} end
    for _, other in ipairs(victims) do out[#out + 1] = drop(p, other) end
  end
end
local fields = {}
for i = 9, 8 + nf, 2 do fields[ARGV[i]] = ARGV[i + 1] end
local merge = exists
if exists and damaged ~= '' then
  local rev = redis.call('ZSCORE', p .. 'by_rev', id)
  merge = (rev and tostring(tonumber(rev)) or '-') ~= damaged
end
if merge then
  local old = redis.call('HMGET', key, 'access_count', 'f_r', 'has_stats')
  local count, old_f_r = tonumber(old[1]), tonumber(old[2])
  if count and count > tonumber(fields['access_count']) then fields['access_count'] = old[1] end
  if old_f_r and old_f_r > tonumber(fields['f_r']) then fields['f_r'] = old[2] end
  if old[3] == '1' and fields['has_stats'] == '0' then
    local names = {'inter', 'intra', 'prefix_num_tokens', 'ranked_tokens', 'recompute_ratio', 'cci'}
    local kept = redis.call('HMGET', key, unpack(names))
    local whole = true
    for i = 1, #names do if not kept[i] then whole = false end end
    if whole then
      for i = 1, #names do fields[names[i]] = kept[i] end
      fields['has_stats'] = '1'
    end
  end
end
local flat = {}
for name, value in pairs(fields) do flat[#flat + 1] = name; flat[#flat + 1] = value end
local seq = exists and redis.call('HGET', key, 'seq') or redis.call('INCR', p .. 'next_seq')
redis.call('HSET', key, 'seq', seq, unpack(flat))
redis.call('ZADD', p .. 'seq', seq, id)
redis.call('ZADD', p .. 'chunk:' .. chunk, seq, id)
redis.call('ZADD', p .. 'by_f_r', fields['f_r'], id)
redis.call('ZADD', p .. 'by_last_access', last, id)
redis.call('ZADD', p .. 'by_rev', redis.call('INCR', p .. 'writes'), id)  -- the row's revision
if not exists then redis.call('INCR', p .. 'generation') end
return out
"""

# ARGV: prefix, variant_id, 1 / max(CFO, eps) (repr), last_access (repr). Returns the fields or nil.
_LUA_RECORD_USE = """
local p, id = ARGV[1], ARGV[2]
local key = p .. 'v:' .. id
if redis.call('EXISTS', key) == 0 then return false end
redis.call('HINCRBY', key, 'access_count', 1)
local f_r = string.format('%.17g', tonumber(redis.call('HGET', key, 'f_r')) + tonumber(ARGV[3]))
redis.call('HSET', key, 'f_r', f_r, 'last_access', ARGV[4])
redis.call('ZADD', p .. 'by_f_r', f_r, id)
redis.call('ZADD', p .. 'by_last_access', ARGV[4], id)
redis.call('ZADD', p .. 'by_rev', redis.call('INCR', p .. 'writes'), id)
return redis.call('HGETALL', key)
"""

# ARGV: prefix, variant_id. Returns the removed fields or nil.
_LUA_REMOVE = _LUA_DROP + """
if redis.call('EXISTS', ARGV[1] .. 'v:' .. ARGV[2]) == 0 then return false end
local fields = drop(ARGV[1], ARGV[2])
redis.call('INCR', ARGV[1] .. 'generation')
return fields
"""

# ARGV: prefix. Returns {ids, revisions}: the variant ids in insertion order joined by newlines, and
# "id revision" lines (the store's write count when the row was last written) in revision order. Two
# strings from one script: a consistent reading, and no RESP array of 10,000 members for redis-py to
# parse (~0.3 s in the scheduler's process). A revision set of another type reads as no revisions.
_LUA_VERSIONS = """
local p = ARGV[1]
local ids = redis.call('ZRANGE', p .. 'seq', 0, -1)
local revs = redis.pcall('ZRANGE', p .. 'by_rev', 0, -1, 'WITHSCORES')
local lines = {}
if not revs.err then
  for i = 1, #revs, 2 do lines[#lines + 1] = revs[i] .. ' ' .. revs[i + 1] end
end
return {table.concat(ids, '\\n'), table.concat(lines, '\\n')}
"""

# ARGV: prefix, index zset suffix ('seq' or 'chunk:<key>'). Returns every listed variant's fields, in
# index order, from one consistent snapshot.
_LUA_RECORDS = """
local out = {}
for _, id in ipairs(redis.call('ZRANGE', ARGV[1] .. ARGV[2], 0, -1)) do
  local fields = redis.pcall('HGETALL', ARGV[1] .. 'v:' .. id)
  if fields.err then fields = {'variant_id', id} end  -- another type under the key: an unreadable row
  out[#out + 1] = fields
end
return out
"""


def _fields(record: VariantRecord) -> dict[str, str]:
    """The record as hash fields (derived cci kept for inspection, like the SQLite column)."""
    return {
        "variant_id": record.variant_id, "chunk_key": record.chunk_key,
        "prefix": json.dumps(list(record.prefix)), "inter": json.dumps(record.inter),
        "intra": repr(float(record.intra)), "num_tokens": str(record.num_tokens),
        "prefix_num_tokens": json.dumps(record.prefix_num_tokens),
        "ranked_tokens": json.dumps(list(record.ranked_tokens)), "cci": repr(record.cci),
        "access_count": str(record.access_count), "f_r": repr(float(record.f_r)),
        "size_bytes": str(record.size_bytes), "tier": record.tier,
        "last_access": repr(float(record.last_access)),
        "recompute_ratio": "" if record.recompute_ratio is None else repr(float(record.recompute_ratio)),
        "has_stats": "1" if record.has_stats else "0",
    }


def _record(h: dict[str, str] | list[str]) -> VariantRecord:
    """A VariantRecord from a variant's hash (a dict, or a script's flat field, value, ... list).

    Raises:
        StoreError: the hash is not a readable variant (written by something else, or damaged).
    """
    if isinstance(h, list):
        h = dict(zip(h[::2], h[1::2], strict=True))
    try:
        record = VariantRecord(
            chunk_key=h["chunk_key"], prefix=tuple(json.loads(h["prefix"])), inter=json.loads(h["inter"]),
            intra=float(h["intra"]), num_tokens=int(h["num_tokens"]),
            prefix_num_tokens=json.loads(h["prefix_num_tokens"]),
            ranked_tokens=tuple(json.loads(h["ranked_tokens"])), access_count=int(h["access_count"]),
            f_r=float(h["f_r"]), size_bytes=int(h["size_bytes"]), tier=h["tier"],
            last_access=float(h["last_access"]),
            recompute_ratio=None if h["recompute_ratio"] == "" else float(h["recompute_ratio"]),
            has_stats=h["has_stats"] == "1")
    except (KeyError, ValueError, TypeError, ArithmeticError, RecursionError) as exc:
        # json.JSONDecodeError is a ValueError; a deeply nested value a RecursionError, int(inf) an
        # OverflowError: one bad hash is a miss, never an error that hides every other record
        raise StoreError(f"redis metastore: unreadable variant {h.get('variant_id')!r}: {exc!r}") from None
    if record.variant_id != h.get("variant_id"):
        raise StoreError(f"redis metastore: variant {h.get('variant_id')!r} holds the fields of "
                         f"{record.variant_id!r}")
    return record


class _LayoutMismatch(StoreError):
    """The namespace holds another metadata layout version: a configuration error, raised at once."""


class RedisMetaStore:
    """Variant metadata in Redis, budgeted to `max_variants` (see the module docstring).

    Thread-safe: the client pools connections; puts and pins of this process are serialized by one lock
    so that a pin cannot slip between a put's choice of victims and their eviction.
    """

    def __init__(self, url: str, *, max_variants: int, policy: str = "f_r",
                 clock: Callable[[], float] = time.time, timeout_s: float = 0.5,
                 namespace: str = "cachefuse", read_only: bool = False) -> None:
        """Connect and check the layout version.

        Args:
            url: "redis://[:password@]host:port/db" or "rediss://..." (TLS).
            max_variants: N x M, the total variant budget over all chunks (>= 1), shared by every
                instance on this namespace (the put that finds the store full evicts).
            policy: "f_r" (Cache-Craft, lowest f_r evicted first) or "lru" (the baseline).
            clock: seconds, stamped into `last_access`; injectable for tests. Instances sharing a
                namespace should share a time base (wall clock) for the LRU order to mean anything.
            timeout_s: socket connect/read timeout of every call.
            namespace: key prefix; instances sharing metadata use the same one.
            read_only: for `cachefuse inspect`: nothing is written, not even the layout keys an empty
                namespace is given at open (an inspect of a mistyped database created a namespace there),
                writes raise StoreError, and the server's eviction policy is not checked (a writer's
                start-up refuses one that would drop bookkeeping keys: redis_client.check_eviction_policy).

        Raises:
            ConfigError: a bad argument. StoreError: Redis unreachable or holding another layout version.
        """
        if max_variants < 1:
            raise ConfigError(f"max_variants={max_variants!r}, expected >= 1")
        if policy not in POLICIES:
            raise ConfigError(f"policy={policy!r}, expected one of {POLICIES}")
        self.max_variants, self.policy, self._clock = max_variants, policy, clock
        self.namespace, self.read_only = namespace, read_only
        self._outage = OutageBackoff(timeout_s)
        self._prefix = f"{namespace}:meta:"
        self._client = redis_client(url, timeout_s, decode_responses=True)
        self._lock = threading.Lock()
        self.unreadable_rows = 0
        """Variant hashes skipped because they did not parse (damaged, or written by something else)."""
        self._pins = PinCounts()
        self._put_script = self._client.register_script(_LUA_PUT)
        self._use_script = self._client.register_script(_LUA_RECORD_USE)
        self._remove_script = self._client.register_script(_LUA_REMOVE)
        self._records_script = self._client.register_script(_LUA_RECORDS)
        self._versions_script = self._client.register_script(_LUA_VERSIONS)
        self._layout_checked = False
        try:
            self._check_layout()
        except _LayoutMismatch:
            raise
        except StoreError as exc:  # unreachable: start serving; every call is a StoreError until it answers
            if isinstance(exc.__cause__, redis.AuthenticationError | redis.exceptions.AuthorizationError):
                raise ConfigError(f"redis_url: Redis refused the credentials ({exc.__cause__}); check the "
                                  "password (in the URL, redis_password_env or redis_password_file)") from None
            logger.warning("redis metastore %r unreachable at start-up (%s); variant metadata calls fail, as "
                           "misses and unsaved variants, until it answers", namespace, exc)
        else:
            if not read_only:  # the K/V tier shares the server (redis_url): one check serves both
                check_eviction_policy(self._client)

    def _check_layout(self) -> None:
        """Checks (once) that the namespace holds this layout version; creates it when empty."""
        with self._redis("open"):
            if not self.read_only:
                self._client.set(self._prefix + "schema_version", SCHEMA_VERSION, nx=True)
                self._client.set(self._prefix + "epoch", uuid.uuid4().hex, nx=True)  # see `generation`
            found = self._client.get(self._prefix + "schema_version")
        if found != SCHEMA_VERSION and not (self.read_only and found is None):  # read-only: empty is fine
            raise _LayoutMismatch(f"redis namespace {self.namespace!r}: metadata layout version {found!r}, "
                                  f"expected {SCHEMA_VERSION!r}")
        self._layout_checked = True

    @contextlib.contextmanager
    def _redis(self, op: str) -> Iterator[None]:
        """Turn any Redis failure (network, timeout, server error) into StoreError. While Redis has stopped
        answering (redis_client.OutageBackoff), no call is sent: each raises at once (a request's pin and
        reuse calls had each waited out the timeout across a partition)."""
        if self.read_only and op in _WRITES:
            raise StoreError(f"redis metastore {op}: opened read-only")
        if self._outage.blocked():
            raise StoreError(f"redis metastore {op}: not sent, Redis has not answered for a while "
                             f"({self._outage.backoff_s:g} s backoff)")
        try:
            if not self._layout_checked and op != "open":  # Redis was down when this store was opened
                self._check_layout()
            yield
        except (redis.RedisError, ValueError, TypeError) as exc:  # also a counter holding garbage
            self._outage.failed(exc)
            raise StoreError(f"redis metastore {op}: {exc!r}") from exc
        self._outage.answered()

    def put(self, record: VariantRecord) -> list[VariantRecord]:
        """Insert or replace `record` (last_access := clock()), evicting on demand when full.

        Returns:
            The evicted variants (empty when none): the caller deletes their K/V.

        Raises:
            StoreError: the store is full and too few variants are unpinned (nothing changed), or Redis
                failed (then the put may or may not have happened, never half of it).
        """
        record = dataclasses.replace(record, last_access=self._clock())
        with self._redis("put"), self._client.pipeline(transaction=False) as pipe:
            pipe.hgetall(self._prefix + "v:" + record.variant_id)
            pipe.zscore(self._prefix + "by_rev", record.variant_id)
            old, revision = pipe.execute()
        damaged = ""  # the script merges (base.merged_upsert) with the row as the write finds it
        if old:
            try:
                _record(old)
            except StoreError:  # replaced whole (choice 6), uncounted, unless rewritten meanwhile
                damaged = "-" if revision is None else str(int(revision))
        fields = _fields(record)
        flat = [item for pair in fields.items() for item in pair]
        with self._lock, self._redis("put"):
            args = [self._prefix, self.max_variants, self.policy, record.variant_id, record.chunk_key,
                    fields["last_access"], len(flat), damaged, *flat, *self._pins]
            reply = self._put_script(args=args)
        if reply[0] == "full":
            count, unpinned = int(reply[1]), int(reply[2])
            raise StoreError(f"metastore full: {count} variants (max {self.max_variants}), {unpinned} "
                             f"unpinned, {count + 1 - self.max_variants} must be evicted to admit a new one; "
                             "not admitted")
        return self._readable(reply[1:])

    def get(self, variant_id: str) -> VariantRecord | None:
        """The variant with this id, or None."""
        with self._redis("get"):
            fields = self._client.hgetall(self._prefix + "v:" + variant_id)
        return self._parse(fields) if fields else None

    def variants(self, chunk_key: str) -> list[VariantRecord]:
        """The chunk's variants in insertion order (empty: a miss)."""
        with self._redis("variants"):
            replies = self._records_script(args=[self._prefix, "chunk:" + chunk_key])
        return self._readable(replies)

    def choose(self, chunk_key: str, new_prefix: Sequence[str],
               alpha: float) -> tuple[VariantRecord, float] | None:
        """The variant to reuse after `new_prefix` and its CFO (scores.choose_variant), or None on a miss."""
        records = self.variants(chunk_key)
        if not records:
            return None
        index, cfo_value = scores.choose_variant([r.to_variant() for r in records], new_prefix, alpha)
        return records[index], cfo_value

    def record_uses(self, uses: Sequence[tuple[str, float]], eps: float = 1e-6) -> int:
        """`record_use` for each (variant id, CFO) pair, in one round trip; each is atomic on its own (a
        script per use, pipelined).

        Returns:
            How many of the variants still existed.
        """
        if not uses:
            return 0
        now = repr(float(self._clock()))
        calls = [self._use_args(variant_id, cfo, eps, now) for variant_id, cfo in uses]
        with self._redis("record_use"):
            for attempt in range(2):
                # EVALSHA straight into the pipeline: a queued Script object makes redis-py send SCRIPT
                # EXISTS first, a second round trip
                pipe = self._client.pipeline(transaction=False)
                for args in calls:
                    pipe.evalsha(self._use_script.sha, 0, *args)
                try:
                    replies = pipe.execute()
                    break
                except redis.exceptions.NoScriptError:  # a restarted or flushed Redis: load it, once
                    if attempt:
                        raise
                    self._client.script_load(_LUA_RECORD_USE)
        return sum(bool(flat) and self._parse(flat) is not None for flat in replies)

    def record_use(self, variant_id: str, cfo: float, eps: float = 1e-6) -> VariantRecord | None:
        """Persist one reuse atomically: access_count += 1, f_r += 1 / max(CFO, eps), last_access.

        Returns:
            The updated record, or None when the variant is gone (evicted or removed).
        """
        args = self._use_args(variant_id, cfo, eps, repr(float(self._clock())))
        with self._redis("record_use"):
            flat = self._use_script(args=args)
        return self._parse(flat) if flat else None

    def _use_args(self, variant_id: str, cfo: float, eps: float, now: str) -> list[str]:
        """_LUA_RECORD_USE's ARGV for one reuse: f_r grows by the same double scores.record_use adds."""
        if not eps > 0.0:
            raise ValueError(f"eps={eps!r}, expected > 0")
        return [self._prefix, variant_id, repr(1.0 / max(cfo, eps)), now]

    def remove(self, variant_id: str) -> VariantRecord | None:
        """Delete a variant; returns it, or None when absent (or unreadable). StoreError when pinned here."""
        with self._lock:
            self._pins.check_unpinned(variant_id)
            with self._redis("remove"):
                flat = self._remove_script(args=[self._prefix, variant_id])
        return self._parse(flat) if flat else None  # a damaged hash is removed all the same

    def _parse(self, fields: dict[str, str] | list[str]) -> VariantRecord | None:
        """The record of one variant hash, or None (logged and counted) when it does not parse."""
        try:
            return _record(fields)
        except StoreError as exc:
            self.unreadable_rows += 1
            logger.warning("%s: skipped", exc)
            return None

    def _readable(self, replies: list[list[str]]) -> list[VariantRecord]:
        """The records of a list read; an unreadable one is skipped, so one bad hash cannot hide every other
        variant from the index."""
        return [record for record in map(self._parse, replies) if record is not None]

    def generation(self) -> int:
        """A value that changes whenever the set of variants changes (choice 7), in any instance: the
        counter, with the namespace's epoch (a random token set when the layout is created) in its high
        bits. A Redis that restarts empty (or loses the counter) and takes as many saves as there were
        before shows the same counter, and an index would keep the old variants; the epoch differs."""
        with self._redis("generation"):
            counter, epoch = self._client.mget(self._prefix + "generation", self._prefix + "epoch")
            if epoch is None and not self.read_only:  # restarted empty under running engines: a new epoch
                self._client.set(self._prefix + "epoch", uuid.uuid4().hex, nx=True)
                counter, epoch = self._client.mget(self._prefix + "generation", self._prefix + "epoch")
        return (zlib.crc32((epoch or "").encode()) << 40) + int(counter or 0)

    def pin(self, variant_id: str) -> None:
        """Protect a stored variant from eviction by this process until the matching unpin (nested).

        Raises:
            KeyError: the variant is absent. StoreError: Redis failed.
        """
        with self._lock:
            with self._redis("pin"):
                exists = self._client.exists(self._prefix + "v:" + variant_id)
            if not exists:
                raise KeyError(variant_id)
            self._pins.add(variant_id)

    def pin_many(self, variant_ids: Sequence[str]) -> list[str]:
        """`pin` of every variant that exists, in one round trip (a request's chunks each cost a call's
        latency otherwise); returns those pinned (absent ones are skipped)."""
        with self._lock:
            with self._redis("pin"):
                pipe = self._client.pipeline(transaction=False)
                for variant_id in variant_ids:
                    pipe.exists(self._prefix + "v:" + variant_id)
                exists = pipe.execute()
            pinned = [variant_id for variant_id, found in zip(variant_ids, exists, strict=True) if found]
            for variant_id in pinned:
                self._pins.add(variant_id)
        return pinned

    def unpin(self, variant_id: str) -> None:
        """Undo one pin; StoreError when the variant is not pinned (an unbalanced unpin is a bug)."""
        with self._lock:
            self._pins.release(variant_id)

    def pin_count(self, variant_id: str) -> int:
        """How many pins this process holds on the variant (0 when unpinned or absent)."""
        with self._lock:
            return self._pins.count(variant_id)

    def count(self) -> int:
        """The number of stored variants over all chunks and instances (<= max_variants)."""
        with self._redis("count"):
            return int(self._client.zcard(self._prefix + "seq"))

    def all_records(self) -> list[VariantRecord]:
        """Every variant, in insertion order (one consistent snapshot)."""
        with self._redis("all_records"):
            replies = self._records_script(args=[self._prefix, "seq"])
        return self._readable(replies)

    def variant_versions(self) -> list[tuple[str, tuple]]:
        """(id, version) of every variant in insertion order, without reading the rows (an index refresh's
        cheap part: kilobytes per thousand variants, where the rows are megabytes to send and parse). The
        version is the row's revision: the store's write count when the row was last written (a put, an
        upsert, a use, a new put after a removal), whatever the clock says; "-" for a row written before
        revisions existed (unchanged since)."""
        with self._redis("variant_versions"):
            ids, revisions = self._versions_script(args=[self._prefix])  # two strings: _LUA_VERSIONS
        revision_of = dict(line.split(" ", 1) for line in revisions.split("\n") if " " in line)
        return [(vid, (revision_of.get(vid, "-"),)) for vid in ids.split("\n") if vid]

    def get_many(self, variant_ids: Sequence[str]) -> list[VariantRecord]:
        """The readable variants among `variant_ids`, in their order (absent and unreadable ones skipped), in
        one pipelined round trip."""
        ids = list(dict.fromkeys(variant_ids))
        if not ids:
            return []
        with self._redis("get_many"):
            pipe = self._client.pipeline(transaction=False)
            for variant_id in ids:
                pipe.hgetall(self._prefix + "v:" + variant_id)
            replies = pipe.execute(raise_on_error=False)
        for reply in replies:  # another type under one key makes that row unreadable; other errors (BUSY,
            if isinstance(reply, Exception) and not str(reply).startswith("WRONGTYPE"):  # LOADING) fail the read
                raise StoreError(f"redis metastore get_many: {reply!r}")
        replies = [{"variant_id": vid} if isinstance(fields, Exception) else fields
                   for vid, fields in zip(ids, replies, strict=True)]
        return self._readable([fields for fields in replies if fields])

    def size_by_tier(self) -> dict[str, int]:
        """tier -> total size_bytes of its variants."""
        totals: dict[str, int] = {}
        for record in self.all_records():
            totals[record.tier] = totals.get(record.tier, 0) + record.size_bytes
        return totals

    def close(self) -> None:
        """Close the connections (idempotent); pins are dropped. The data stays in Redis."""
        with self._lock:
            self._pins.clear()
        self._client.close()

    def __enter__(self) -> RedisMetaStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Variant metadata in Redis, shared by several vLLM instances: cachefuse.metadata.base's contract.

Imports the standard library, redis, `cachefuse.{metadata.base, metadata.redis_scripts, metadata.scores,
redis_client, errors}`;
no torch (the scheduler reads it). Every choice of base.py's docstring (1-7) holds exactly as in
`SqliteMetaStore`; tests/metadata/test_contract.py runs one suite over both. Layout, every key under `{namespace}:meta:`:

    v:{variant_id}     hash: the VariantRecord's fields (JSON for prefix, inter, prefix_num_tokens,
                       ranked_tokens; floats as repr, which round-trips) and `seq`, its insertion number
    chunk:{chunk_key}  zset: the chunk's variant ids, scored by seq (insertion order)
    seq                zset: every variant id by seq (count, all_records)
    by_f_r             zset: id -> f_r         } the primary eviction key of each policy; ties are
    by_last_access     zset: id -> last_access } broken in the script by (the other one, seq)
    next_seq, generation, schema_version: counters / the layout version

Atomicity: put (with its evictions), record_use and remove are each one Lua script (redis_scripts.py), so concurrent
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

from cachefuse import call_deadline
from cachefuse.errors import ConfigError, StoreError
from cachefuse.metadata import redis_scripts, scores
from cachefuse.metadata.base import POLICIES, PinCounts, VariantRecord
from cachefuse.redis_client import OutageBackoff, check_eviction_policy, redis_client

logger = logging.getLogger(__name__)

SCHEMA_VERSION = "1"
_WRITES = frozenset({"put", "record_use", "remove"})
"""Operations a read-only store (`cachefuse inspect`) refuses."""

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
        "exact_after": record.exact_after or "",  # always written: an upsert's K/V replace the old ones
        "neighbour_fused": "1" if record.neighbour_fused else "0",  # likewise
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
            has_stats=h["has_stats"] == "1",
            exact_after=h.get("exact_after") or None,  # absent: written before exact places
            neighbour_fused=h.get("neighbour_fused") == "1")  # absent: written before origins
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
        self._put_script = self._client.register_script(redis_scripts.PUT)
        self._use_script = self._client.register_script(redis_scripts.RECORD_USE)
        self._remove_script = self._client.register_script(redis_scripts.REMOVE)
        self._records_script = self._client.register_script(redis_scripts.RECORDS)
        self._versions_script = self._client.register_script(redis_scripts.VERSIONS)
        self._layout_checked = False
        self._first_contact()

    def _first_contact(self) -> None:
        """The constructor's one talk with Redis: the layout version checked (another raises), the server's
        eviction policy checked (writers only). Refused credentials raise ConfigError; an unreachable Redis
        is logged, and the first call that gets through checks the layout."""
        try:
            self._check_layout()
        except _LayoutMismatch:
            raise
        except StoreError as exc:  # unreachable: start serving; every call is a StoreError until it answers
            if isinstance(exc.__cause__, redis.AuthenticationError | redis.exceptions.AuthorizationError):
                raise ConfigError(f"redis_url: Redis refused the credentials ({exc.__cause__}); check the "
                                  "password (in the URL, redis_password_env or redis_password_file)") from None
            logger.warning("redis metastore %r unreachable at start-up (%s); variant metadata calls fail, as "
                           "misses and unsaved variants, until it answers", self.namespace, exc)
        else:
            if not self.read_only:  # the K/V tier shares the server (redis_url): one check serves both
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
        reuse calls had each waited out the timeout across a partition). Inside a deadline scope (a blend's
        load budget, cachefuse.call_deadline) a call ends by it, cut mid-reply if need be, and none is sent
        once it has passed."""
        if self.read_only and op in _WRITES:
            raise StoreError(f"redis metastore {op}: opened read-only")
        if self._outage.blocked():
            raise StoreError(f"redis metastore {op}: not sent, Redis has not answered for a while "
                             f"({self._outage.backoff_s:g} s backoff)")
        if call_deadline.passed():
            raise StoreError(f"redis metastore {op}: not sent, the call's deadline has passed")
        try:
            if not self._layout_checked and op != "open":  # Redis was down when this store was opened
                self._check_layout()
            yield
        except (redis.RedisError, ValueError, TypeError) as exc:  # also a counter holding garbage
            if not call_deadline.cut_by_deadline():  # a call our deadline cut says nothing of the server
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
                    self._client.script_load(redis_scripts.RECORD_USE)
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
        """redis_scripts.RECORD_USE's ARGV for one reuse: f_r grows by the double scores.record_use adds."""
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
            ids, revisions = self._versions_script(args=[self._prefix])  # two strings: redis_scripts.VERSIONS
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

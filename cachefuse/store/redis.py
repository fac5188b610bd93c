"""Redis tier: K/V entries shared by several vLLM instances, one Redis hash per entry.

Imports torch, redis, `cachefuse.store.{base, entry_format}` (the disk tier's header and tensor checks,
reused as they are) and `cachefuse.redis_client` (torch-free, so the scheduler side can share it). Layout,
every key under `{namespace}:kv:`:

    e:{key}     hash: "header" (JSON of disk.py's safetensors metadata: format, format_version,
                model_fingerprint, num_layers, dtype, num_tokens, checksum.k.{i} / checksum.v.{i},
                meta.<name>; plus shape.k.{i} / shape.v.{i}, e.g. "5,2,8"), and "k.{i}" / "v.{i}", the
                raw tensor bytes (row-major, little-endian, storage dtype: safetensors' data layout)
    sizes       hash: key -> stored bytes (header + tensor fields)
    lru         zset: key -> last-use stamp, from the shared counter `clock` (one order for all instances)
    nbytes      the sum of `sizes`
    tmp:{token} a put's staging hash; expires after STAGING_TTL_S if its writer dies mid-put

Why a hash per entry: `get_layer` reads one layer with one HMGET of three fields (header, k.i, v.i),
never the whole entry, and verifies only that layer (like disk.py).

A put writes the staging hash in one MULTI/EXEC, then one Lua script, atomically: evicts least recently
used unpinned entries (disk.py's plan_eviction rule; the pins are this process's, passed in), renames the
staging hash over the entry and updates the index. Readers see the whole old entry or the whole new one;
the tensor bytes never pass through Lua. A refused put (does not fit) leaves the previous entry. A put
that times out returns False but may still land later, whole. capacity_bytes > 0 is a budget over the
namespace, shared by every instance on it; 0 is no budget of ours (Redis's own maxmemory applies with
`noeviction`: a full Redis refuses puts; a server whose policy evicts any key, `allkeys-*`, is refused at
start-up by the metadata store on the same server, since it would drop the bookkeeping keys with the
entries: redis_client.check_eviction_policy). The scripts (redis_scripts.py) derive key
names from the namespace, so they need standalone Redis (or one shard), not Redis Cluster.

Misses, as in disk.py: "foreign_model", "shape_mismatch", "corrupt" (bad checksum, missing or
overlong field, unparsable header, a key of another Redis type; a field, the header included, longer
than the whole entry's recorded size is dropped by the read script before any byte is sent),
"truncated" (a field shorter than its shape, a header cut short, an empty header); each drops the entry
unless a put replaced it meanwhile.
Any Redis error (connection refused or reset, timeout, a server error reply) is "io_error" and keeps
the entry. Nothing raises out of get / get_layer / contains / put / remove / keys / nbytes: every call
returns within about `timeout_s` per round trip (redis_client never retries), and by the calling thread's
deadline where one is open (a blend's load budget, cachefuse.call_deadline): a reply trickled in past it
is cut mid-way, its connection dropped, and the read is an "io_error" miss that the blend counts as
"load_timeout".
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable

import redis
import torch

from cachefuse import call_deadline
from cachefuse.chunks import dtype_name
from cachefuse.errors import ConfigError, StoreError
from cachefuse.redis_client import OUTAGE_BACKOFF_S, OutageBackoff, redact_url, redis_client
from cachefuse.store import base, entry_format, redis_scripts
from cachefuse.store.base import ChunkKV, StoreIdentity

logger = logging.getLogger(__name__)

STAGING_TTL_S = 300


class _Skipped(redis.ConnectionError):
    """A call not sent: Redis stopped answering, and the outage backoff runs (redis_client.OutageBackoff)."""


def encode_fields(entry: ChunkKV, identity: StoreIdentity) -> dict[str, bytes]:
    """The hash fields of `entry`: "header" (JSON, see the module docstring) and "k.{i}" / "v.{i}" bytes."""
    header = {
        "format": entry_format.FORMAT, "format_version": entry_format.FORMAT_VERSION,
        "model_fingerprint": identity.model_fingerprint, "num_layers": str(identity.num_layers),
        "dtype": dtype_name(identity.dtype), "num_tokens": str(entry.num_tokens),
    }
    fields: dict[str, bytes] = {}
    for layer, (k_nope, v) in enumerate(zip(entry.k_nope, entry.v, strict=True)):
        for name, t in ((f"k.{layer}", k_nope), (f"v.{layer}", v)):
            t = t.detach().cpu().contiguous()
            header[f"checksum.{name}"] = entry_format.checksum(t)
            header[f"shape.{name}"] = ",".join(str(n) for n in t.shape)
            fields[name] = t.reshape(-1).view(torch.uint8).numpy().tobytes()  # [numel * element_size]
    header.update({f"meta.{name}": value for name, value in entry.meta.items()})
    return {"header": json.dumps(header, separators=(",", ":")).encode(), **fields}


def _parse_header(raw: bytes) -> dict[str, str]:
    """The header's JSON object of strings, or entry_format.EntryMiss ("truncated" if it stops mid-document)."""
    if len(raw) > base.MAX_ENTRY_HEADER_BYTES:  # a shared Redis is anyone's to write
        raise entry_format.EntryMiss(base.MISS_CORRUPT, f"header of {len(raw)} bytes, over {base.MAX_ENTRY_HEADER_BYTES}")
    try:
        header = json.loads(raw)
    except json.JSONDecodeError as exc:
        cut = exc.pos >= len(exc.doc.rstrip()) or exc.msg.startswith("Unterminated string")
        raise entry_format.EntryMiss(base.MISS_TRUNCATED if cut else base.MISS_CORRUPT, f"header: {exc}") from None
    except (ValueError, RecursionError) as exc:  # not UTF-8; nested past the parser's depth
        raise entry_format.EntryMiss(base.MISS_CORRUPT, f"header: {type(exc).__name__}") from None
    if not isinstance(header, dict) or not all(isinstance(v, str) for v in header.values()):
        raise entry_format.EntryMiss(base.MISS_CORRUPT, "header is not a JSON object of strings")
    return header


class _Fields:
    """The fields of one HMGET behind the two calls entry_format.read_tensor makes of a safetensors file."""

    def __init__(self, values: dict[str, bytes | None], header: dict[str, str], dtype: torch.dtype) -> None:
        self._values, self._header, self._dtype = values, header, dtype

    def keys(self) -> list[str]:
        return [name for name, raw in self._values.items() if raw is not None]

    def get_tensor(self, name: str) -> torch.Tensor:
        raw = self._values[name]
        try:
            shape = [int(n) for n in self._header[f"shape.{name}"].split(",")]
        except (KeyError, ValueError):
            raise entry_format.EntryMiss(base.MISS_CORRUPT, f"{name}: no valid shape in the header") from None
        if any(n < 0 for n in shape):
            raise entry_format.EntryMiss(base.MISS_CORRUPT, f"{name}: shape {shape}")
        expected = math.prod(shape) * self._dtype.itemsize
        if len(raw) != expected:
            reason = base.MISS_TRUNCATED if len(raw) < expected else base.MISS_CORRUPT
            raise entry_format.EntryMiss(reason, f"{name}: {len(raw)} bytes, shape {shape} needs {expected}")
        if expected == 0:
            return torch.empty(shape, dtype=self._dtype)
        return torch.frombuffer(bytearray(raw), dtype=self._dtype).reshape(shape)  # owns a fresh copy


class _Pins(base.PinTable):
    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self._counts)


class RedisKVStore(base.PinnedKeysMixin, base.LayerReadsMixin):
    """Redis tier (see the module docstring for layout, atomicity, budget and miss reasons).

    `name` ("redis") labels the tier in measured load figures. Pins are per process, in memory.

    Args:
        url: "redis://[[user]:password@]host:port/db" or "rediss://..." (TLS).
        identity: what every entry must match.
        capacity_bytes: budget of stored bytes over the namespace; 0: none of ours.
        timeout_s: socket connect/read timeout of every round trip.
        namespace: key prefix; instances sharing K/V use the same one.
    """

    name = "redis"

    def __init__(self, url: str, identity: StoreIdentity, capacity_bytes: int = 0, *,
                 timeout_s: float = 0.5, namespace: str = "cachefuse", outage_backoff_s: float = OUTAGE_BACKOFF_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity_bytes < 0:
            raise ConfigError(f"redis capacity_bytes={capacity_bytes!r}, expected >= 0 (0: no budget)")
        self.identity = identity
        self.capacity_bytes = capacity_bytes
        self.stats = base.StoreStats()
        self._client = redis_client(url, timeout_s)
        self._prefix = f"{namespace}:kv:"
        self._lru, self._clock, self._sizes, self._total = (
            self._prefix + name for name in ("lru", "clock", "sizes", "nbytes"))
        self._read = self._client.register_script(redis_scripts.READ)
        self._drop = self._client.register_script(redis_scripts.DROP)
        self._admit = self._client.register_script(redis_scripts.ADMIT)
        self._pins = _Pins()
        self._lock = threading.Lock()  # guards stats and the reachability flag
        self._unreachable = False
        self._outage = OutageBackoff(timeout_s, outage_backoff_s, clock)

    def _entry(self, key: str) -> str:
        return f"{self._prefix}e:{key}"

    def _drop_entry(self, key: str, *mode: str | bytes) -> None:
        """Run redis_scripts.DROP for `key` (mode: see the script); raises redis.RedisError."""
        self._drop(keys=[self._entry(key), self._lru, self._sizes, self._total], args=[key, *mode])

    @property
    def nbytes(self) -> int:
        """Stored bytes over the namespace (0 when Redis does not answer)."""
        try:
            self._guard()
            total = int(self._client.get(self._total) or 0)
            self._reachable()
            return total
        except (redis.RedisError, ValueError) as exc:  # ValueError: the counter holds something else
            self._io_error("nbytes", exc)
            return 0

    def put(self, key: str, entry: ChunkKV) -> bool:
        """Store `entry`, evicting least recently used unpinned entries as the budget needs.

        Returns:
            False (logged, counted) if the entry is foreign, does not fit even after evicting every
            entry not pinned here, or Redis fails; the previous entry of `key`, if any, is then kept.
        """
        base.check_key(key)
        mismatch = base.entry_mismatch(entry, self.identity)
        if mismatch is not None:
            return self._fail(key, "foreign entry ({}: {})".format(*mismatch))
        try:
            fields = encode_fields(entry, self.identity)
        except Exception as exc:  # whatever cannot be serialized fails this put, not the caller
            return self._fail(key, f"cannot serialize: {exc!r}")
        nbytes = sum(len(value) for value in fields.values())
        staging = f"{self._prefix}tmp:{uuid.uuid4().hex}"
        try:
            self._guard()
            with self._client.pipeline(transaction=True) as pipe:
                pipe.hset(staging, mapping=fields)
                pipe.expire(staging, STAGING_TTL_S)
                pipe.execute()
            keys = [staging, self._entry(key), self._lru, self._clock, self._sizes, self._total]
            args = [key, nbytes, self.capacity_bytes, self._entry(""), *self._pins.snapshot()]
            reply = self._admit(keys=keys, args=args)
        except redis.RedisError as exc:  # the staging hash, if written, expires by itself
            self._io_error(f"put {key}", exc)
            return self._fail(key, None)
        self._reachable()
        if reply[0] == -1:
            return self._fail(key, f"staging hash expired before admission ({STAGING_TTL_S} s)")
        if reply[0] != 1:
            return self._fail(key, f"{nbytes} bytes do not fit in {self.capacity_bytes} even after evicting "
                                   "every unpinned entry")
        with self._lock:
            self.stats.evictions += len(reply) - 1
            self.stats.puts += 1
            self.stats.bytes_written += nbytes
        for victim in reply[1:]:
            logger.debug("redis evicted %s", victim.decode())
        return True

    def size_of(self, key: str) -> int | None:
        """The stored bytes of `key` (header and fields, as the budget counts them), or None when absent or
        Redis does not answer: what a placement policy asks before it reads an entry to promote."""
        try:
            self._guard()
            size = self._client.hget(self._sizes, key)
            self._reachable()
            return int(size) if size is not None else None
        except (redis.RedisError, ValueError) as exc:
            self._io_error("size_of", exc)
            return None

    def contains(self, key: str) -> bool:
        """Whether the entry exists (one round trip); False when Redis does not answer."""
        try:
            self._guard()
            found = bool(self._client.exists(self._entry(key)))
        except redis.RedisError as exc:
            self._io_error("contains", exc)
            return False
        self._reachable()
        return found

    def remove(self, key: str) -> None:
        """Drop `key` if present (pinned or not: pins only guard against eviction); logged on failure."""
        base.check_key(key)
        try:
            self._guard()
            self._drop_entry(key, "any")
        except redis.RedisError as exc:
            self._io_error("remove", exc)
            return
        self._reachable()

    def keys(self) -> list[str]:
        """Indexed keys, least recently used first ([] when Redis does not answer)."""
        try:
            self._guard()
            members = self._client.zrange(self._lru, 0, -1)
        except redis.RedisError as exc:
            self._io_error("keys", exc)
            return []
        self._reachable()
        keys = []
        for member in members:  # a member another client wrote (not one of our keys) is skipped
            key = member.decode("utf-8", "replace") if isinstance(member, bytes) else ""
            if base.is_valid_key(key):
                keys.append(key)
            else:
                logger.debug("redis keys: skipped a member that is not a key: %r", member[:40])
        return keys

    def close(self) -> None:
        """Close the connections (a later call reconnects)."""
        self._client.close()

    def _load(self, key: str, layers: range) -> entry_format.Layers | None:
        """Read and verify `layers` of `key`; None on a miss, with bad entries dropped."""
        names = [f"{kv}.{layer}" for layer in layers for kv in "kv"]
        keys = [self._entry(key), self._lru, self._clock, self._sizes, self._total]
        try:
            self._guard()
            reply = self._read(keys=keys, args=[key, "header", *names])
        except redis.RedisError as exc:
            self._io_error("get", exc)
            return self._miss(key, base.MISS_IO_ERROR, repr(exc), None)
        self._reachable()
        if reply[0] == 0:
            return self._miss(key, base.MISS_ABSENT, "no such entry", None)
        if reply[0] == -1:
            return self._miss(key, base.MISS_CORRUPT, "key holds another Redis type", "any")
        if reply[0] == -2:  # dropped by the script itself
            _, field, length, size = reply
            with self._lock:
                self.stats.record_miss(base.MISS_CORRUPT)
            logger.warning("redis miss %s: %s (field %s of %d bytes, over the %d the whole entry was stored with; "
                           "dropped)", key, base.MISS_CORRUPT, field.decode(errors="replace"), length, size)
            return None
        header_raw = reply[1]
        if header_raw is None:
            return self._miss(key, base.MISS_CORRUPT, "no header", "no-header")
        try:
            k_nope, v, meta = self._decode(header_raw, dict(zip(names, reply[2:], strict=True)), layers)
        except entry_format.EntryMiss as miss:
            return self._miss(key, miss.reason, miss.detail, header_raw)
        except Exception as exc:  # whatever else bad bytes provoke must stay a miss
            return self._miss(key, base.MISS_CORRUPT, repr(exc), header_raw)
        with self._lock:
            self.stats.hits += 1
            self.stats.bytes_read += sum(t.nbytes for t in (*k_nope, *v))
        return k_nope, v, meta

    def _decode(self, header_raw: bytes, values: dict[str, bytes | None], layers: range) -> entry_format.Layers:
        header = _parse_header(header_raw)
        num_tokens = entry_format.check_header(header, self.identity)
        fields = _Fields(values, header, self.identity.dtype)
        k_nope, v = [], []
        for layer in layers:
            k_nope.append(entry_format.read_tensor(fields, f"k.{layer}", header, num_tokens, self.identity.dtype))
            v.append(entry_format.read_tensor(fields, f"v.{layer}", header, num_tokens, self.identity.dtype))
            if k_nope[-1].shape[1] != v[-1].shape[1]:
                raise entry_format.EntryMiss(base.MISS_SHAPE_MISMATCH, f"layer {layer}: K and V differ in num_kv_heads")
        meta = {name[len("meta."):]: value for name, value in header.items() if name.startswith("meta.")}
        return k_nope, v, meta

    def _miss(self, key: str, reason: str, detail: str, seen: bytes | str | None) -> None:
        """Count the miss; drop a bad entry unless a put replaced it since we read `seen` (its header)."""
        with self._lock:
            self.stats.record_miss(reason)
        if reason in (base.MISS_ABSENT, base.MISS_IO_ERROR):
            logger.debug("redis miss %s: %s (%s)", key, reason, detail)
            return None
        logger.warning("redis miss %s: %s (%s)", key, reason, detail)
        mode = [seen] if isinstance(seen, str) else ["header", seen]
        try:
            self._drop_entry(key, *mode)
        except redis.RedisError as exc:
            logger.debug("redis store could not drop bad entry %s: %r", key, exc)
        return None

    def _fail(self, key: str, reason: str | None) -> bool:
        """Count a failed put; log `reason` (None: already logged by _io_error)."""
        with self._lock:
            self.stats.put_failures += 1
        if reason is not None:
            logger.warning("redis put %s failed: %s", key, reason)
        return False

    def _guard(self) -> None:
        """Raises _Skipped (a redis.ConnectionError, handled as any) during an outage backoff, and
        redis.TimeoutError when the calling thread's deadline (a blend's load budget) has already passed."""
        if self._outage.blocked():
            raise _Skipped(f"not sent: Redis has not answered for a while ({self._outage.backoff_s:g} s backoff)")
        if call_deadline.passed():
            raise redis.TimeoutError("not sent: the call's deadline has passed")

    def _io_error(self, op: str, exc: Exception) -> None:
        """Log the first failure of an outage at WARNING, the rest at DEBUG (a down Redis is not news); a
        timeout counts towards the outage backoff, an error reply as an answer (a refused or reset
        connection fails at once: neither). A call the thread's deadline cut says nothing of the server:
        it is logged at DEBUG and counts towards nothing."""
        if call_deadline.cut_by_deadline():
            logger.debug("redis %s cut at the call's deadline, treating as a miss: %r", op, exc)
            return
        self._outage.failed(exc)
        with self._lock:
            first, self._unreachable = not self._unreachable, True
        (logger.warning if first else logger.debug)("redis %s failed, treating as a miss: %r", op, exc)

    def _reachable(self) -> None:
        self._outage.answered()
        if self._unreachable:
            with self._lock:
                self._unreachable = False
            logger.info("redis store reachable again")


def list_redis_keys(url: str, *, timeout_s: float = 0.5, namespace: str = "cachefuse") -> set[str]:
    """The K/V keys a Redis tier indexes (for `cachefuse inspect`; needs no model identity).

    Raises:
        StoreError: Redis did not answer.
    """
    client = redis_client(url, timeout_s)
    try:
        return {key.decode() for key in client.zrange(f"{namespace}:kv:lru", 0, -1)}
    except redis.RedisError as exc:
        raise StoreError(f"redis at {redact_url(url)}: {type(exc).__name__}: {exc}") from exc
    finally:
        client.close()

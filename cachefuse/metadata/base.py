"""The variant metadata contract: the record, its ids and K/V keys, pins, and the `MetaStore` protocol.

Imports only the standard library, `cachefuse.metadata.scores` (the Cache-Craft math, not repeated
here) and `cachefuse.errors`; no torch, no vllm: the scheduler reads it. Every backend
(`metadata/sqlite.py`, `metadata/redis.py`) imports this module and nothing else of the package; the
factory that picks one lives in `metadata/__init__.py`. The K/V bytes live in `cachefuse.store`; a
variant's record holds what Cache-Craft's metadata store holds per variant: the ordered prefix,
inter/intra attention, CCI, the recompute-token ranking, access count, f_r, size and tier.

Choices every backend follows (tests/metadata/test_contract.py runs one suite over both):

1. Identity. A variant is one (chunk key, ordered prefix) pair; `variant_id` is the first 16 hex
   digits of sha256 over the JSON of both, so the same pair always gets the same id. `put` of an
   existing id is an upsert (`merged_upsert`): the fields are replaced but the uses it has gathered
   (access_count and f_r keep the larger value) and, when the new record has no attention statistics,
   the old record's statistics; the variant keeps its insertion order, which `variants()` returns and
   `choose()` breaks ties by (scores choice 9). Two engines saving the same variant at once (each
   checked before the other's row existed) otherwise reset a popular variant's f_r to that of a new
   one, the first in line for eviction. The merge is made with the row as the write finds it (SQLite: in
   the put's transaction; Redis: in the put script), so a reuse recorded meanwhile is not lost. A row
   that does not parse is replaced whole (choice 6).
2. Budget. `max_variants` is N x M, the total number of variants over all chunks; one chunk may own
   all of them (M is not a per-chunk cap). The per-tier byte budget belongs to the K/V tiers; a
   metadata store only reports `size_by_tier()`.
3. Admission evicts on demand: a `put` of a new variant into a full store evicts, in the same
   transaction, the lowest-f_r unpinned variants (ties: least recently used, then oldest) until the
   new one fits, and returns them so the caller deletes their K/V. There is no periodic pass.
   Policy "lru" orders victims by `last_access` instead (ties: lower f_r, then oldest); it exists as
   the comparison baseline. `last_access` is stamped by the store's clock on `put` and `record_use`.
4. Pins. `pin(id)` marks a variant in use by a request (nested: n pins need n unpins); a pinned
   variant is never evicted and `remove()` refuses it. Pins live in memory only: after a restart no
   request holds one.
5. Refusal. When the store is full and too few variants are unpinned, `put` raises `StoreError` and
   changes nothing: the caller drops the K/V it computed (the chunk stays a miss). A refusal is the
   only way `count()` stays at the budget without admitting; it never exceeds it.
6. Misses are return values: `get`, `choose` and `record_use` return None for an unknown id/chunk.
   A stored variant that does not parse (a damaged row or hash, or one written by something else) is a
   miss too: skipped by the list reads, None from `get`, logged, and counted in `unreadable_rows`; a
   `put` of the same variant replaces it, and an eviction that needs room removes it first.
7. K/V location. A variant's K/V entry lives in the K/V tiers under `store_key`: the plain chunk key
   for the empty prefix (the base variant precompute stores, also what stores without metadata hold),
   `<chunk key>-<variant id>` otherwise. `generation()` changes whenever the set of variants changes
   (put of a new id, eviction, remove), so an index can poll it cheaply and reload only on change.
8. Exact places. `exact_after` records the place (chunks.place_hash of every token before the chunk)
   its K/V were computed in, only when they are a full prefill's there: precompute after the system
   prompt, or a hole whose every earlier row of its pass was exact (fusion.saving). A put always comes
   with a write of the K/V it describes, so an upsert takes the new record's value, never the old one's.
9. Origin. `neighbour_fused` marks a variant the offline neighbour step stored (cachefuse.offline: the chunk
   computed after its most similar chunks); a served request's hole never carries it. Rule 8 of
   cachefuse.metadata.index loads only such variants out of their place. Like `exact_after` it describes
   the K/V written with the put, so an upsert takes the new record's value. A store written before the
   field reads every row as not neighbour-fused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from cachefuse.errors import StoreError
from cachefuse.metadata import scores

POLICIES = ("f_r", "lru")
"""Eviction orders (choice 3): Cache-Craft's f_r, or least recently used as the baseline."""


def make_variant_id(chunk_key: str, prefix: Sequence[str]) -> str:
    """The stable id of the (chunk, ordered prefix) pair: sha256[:16] of their JSON (choice 1)."""
    blob = json.dumps([chunk_key, list(prefix)], separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def variant_store_key(chunk_key: str, prefix: Sequence[str]) -> str:
    """Where the variant's K/V live in the K/V tiers (choice 7): the chunk key for the empty prefix."""
    return chunk_key if not prefix else f"{chunk_key}-{make_variant_id(chunk_key, prefix)}"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


MAX_PREFIX_CHUNKS = 4096
"""More prefix chunks than a variant is ever saved with (config `max_variant_prefix_chunks` is capped here):
a row claiming more was written by something else, and planning would pay for its length in `schedule()`
(a 300,000-chunk prefix cost 1 s per request that held the chunk)."""
MAX_NUM_TOKENS = 1 << 20
"""More tokens than any chunk has (the disk tier's bound too)."""
MAX_KEY_CHARS = 200
"""A chunk key past this is not one (32 hex digits; the K/V tiers' keys stop at 200 characters too)."""


def _all_ints(values: Sequence[object]) -> bool:
    """Every value an int, not a bool. Rankings hold a chunk's every token and are checked on each index
    reload (10,000 variants of 512 tokens: 5 M values): the type set is built in C, the per-value Python
    check runs only when some value is not a plain int."""
    return set(map(type, values)) <= {int} or all(map(_is_int, values))


def _check_types(record: VariantRecord) -> None:
    """Every field of the type the math expects: a row read back from a store may hold anything (a damaged
    block, another writer), and a record is the one place both backends build from what they read."""
    bad = [name for name, ok in (
        ("chunk_key", isinstance(record.chunk_key, str)),
        ("prefix", isinstance(record.prefix, list | tuple) and all(isinstance(k, str) for k in record.prefix)),
        ("inter", isinstance(record.inter, dict) and all(isinstance(k, str) and _is_real(v)
                                                         for k, v in record.inter.items())),
        ("intra", _is_real(record.intra)),
        ("num_tokens", _is_int(record.num_tokens) and record.num_tokens > 0),
        ("prefix_num_tokens", isinstance(record.prefix_num_tokens, dict) and all(
            isinstance(k, str) and _is_int(v) for k, v in record.prefix_num_tokens.items())),
        ("ranked_tokens", isinstance(record.ranked_tokens, list | tuple) and _all_ints(record.ranked_tokens)),
        ("access_count", _is_int(record.access_count)),
        ("f_r", _is_real(record.f_r)),
        ("size_bytes", _is_int(record.size_bytes)),
        ("tier", isinstance(record.tier, str)),
        ("last_access", _is_real(record.last_access)),
        ("recompute_ratio", record.recompute_ratio is None or _is_real(record.recompute_ratio)),
        ("has_stats", isinstance(record.has_stats, bool)),
        ("exact_after", record.exact_after is None or (isinstance(record.exact_after, str)
                                                      and 0 < len(record.exact_after) <= MAX_KEY_CHARS)),
        ("neighbour_fused", isinstance(record.neighbour_fused, bool)),
    ) if not ok]
    if bad:
        raise TypeError(f"VariantRecord fields of the wrong type: {', '.join(bad)}")
    sizes = {"chunk_key": (len(record.chunk_key), MAX_KEY_CHARS),
             "prefix keys": (max(map(len, record.prefix), default=0), MAX_KEY_CHARS),
             "prefix": (len(record.prefix), MAX_PREFIX_CHUNKS),
             "inter": (len(record.inter), len(record.prefix) + 1),
             "prefix_num_tokens": (len(record.prefix_num_tokens), len(record.prefix) + 1),
             "num_tokens": (record.num_tokens, MAX_NUM_TOKENS),
             "ranked_tokens": (len(record.ranked_tokens), record.num_tokens)}
    over = [f"{name} ({size} > {limit})" for name, (size, limit) in sizes.items() if size > limit]
    if over:
        raise ValueError(f"VariantRecord fields past their bounds: {', '.join(over)}")


def merged_upsert(old: VariantRecord | None, new: VariantRecord) -> VariantRecord:
    """What a put of `new` over the stored `old` (None: absent or unreadable) writes (choice 1)."""
    if old is None:
        return new
    merged = dataclasses.replace(new, access_count=max(old.access_count, new.access_count),
                                 f_r=max(old.f_r, new.f_r))
    if old.has_stats and not new.has_stats:
        merged = dataclasses.replace(merged, inter=old.inter, intra=old.intra,
                                     prefix_num_tokens=old.prefix_num_tokens, ranked_tokens=old.ranked_tokens,
                                     recompute_ratio=old.recompute_ratio, has_stats=True)
    return merged


@dataclass(frozen=True)
class VariantRecord:
    """One stored variant's metadata: a snapshot; change it through the store (put, record_use).

    `variant_id` and `cci` are derived in `__post_init__`; construction validates the attention
    fields exactly as `scores.Variant` does.
    """

    chunk_key: str
    prefix: tuple[str, ...]
    """Chunk keys before the chunk when its K/V was computed, in prompt order."""
    inter: dict[str, float]
    intra: float
    num_tokens: int
    prefix_num_tokens: dict[str, int] = field(default_factory=dict)
    ranked_tokens: tuple[int, ...] = ()
    """Token offsets within the chunk, highest inter-attention from the prefix first (recompute order)."""
    access_count: int = 0
    f_r: float = 0.0
    size_bytes: int = 0
    tier: str = "disk"
    last_access: float = 0.0
    recompute_ratio: float | None = None
    """The recompute ratio its prefix was fused under; None when computed after the system prompt alone."""
    has_stats: bool = True
    """False when the K/V were stored without attention statistics (inter/intra zeros: CCI 0.5,
    beta the unweighted share of meta choice 6, no ranking)."""
    exact_after: str | None = None
    """`chunks.place_hash` of exactly the tokens before the chunk in the prompt its K/V were computed in,
    set only when those K/V are what a full prefill of that prompt computes (choice 8); None: approximate,
    or not known."""
    neighbour_fused: bool = False
    """Stored by the offline neighbour step (FusionRAG's fused cache: the chunk computed after its most
    similar chunks), never by a served request's hole (choice 9); rule 8 of cachefuse.metadata.index loads
    only these where a chunk's base variant would be loaded after other chunks."""
    variant_id: str = field(init=False)
    cci: float = field(init=False)

    def __post_init__(self) -> None:
        _check_types(self)
        object.__setattr__(self, "prefix", tuple(self.prefix))
        ranked = tuple(self.ranked_tokens)
        if not set(map(type, ranked)) <= {int}:
            ranked = tuple(map(int, ranked))  # int subclasses (never bool: checked above) as plain ints
        object.__setattr__(self, "ranked_tokens", ranked)
        if ranked and not (min(ranked) >= 0 and max(ranked) < self.num_tokens):
            bad = [t for t in ranked if not 0 <= t < self.num_tokens]
            raise ValueError(f"ranked_tokens {bad[:5]} outside 0..{self.num_tokens - 1}")
        if self.size_bytes < 0 or self.access_count < 0:
            raise ValueError(f"size_bytes={self.size_bytes!r}, access_count={self.access_count!r}, expected >= 0")
        object.__setattr__(self, "variant_id", make_variant_id(self.chunk_key, self.prefix))
        object.__setattr__(self, "cci", self.to_variant().cci)

    @property
    def store_key(self) -> str:
        """The key of this variant's K/V entry in the K/V tiers (choice 7)."""
        return variant_store_key(self.chunk_key, self.prefix)

    @classmethod
    def without_stats(cls, chunk_key: str, prefix: Sequence[str], num_tokens: int,
                      prefix_num_tokens: dict[str, int] | None = None, **kw) -> VariantRecord:
        """A variant whose K/V came without attention statistics (zeros; see `has_stats`)."""
        prefix = tuple(prefix)
        lengths = dict(prefix_num_tokens or {})
        for key in prefix:
            lengths.setdefault(key, 1)
        return cls(chunk_key=chunk_key, prefix=prefix, inter=dict.fromkeys(prefix, 0.0), intra=0.0,
                   num_tokens=num_tokens, prefix_num_tokens=lengths, has_stats=False, **kw)

    def to_variant(self) -> scores.Variant:
        """The scoring view (a fresh scores.Variant; mutating it does not change the record)."""
        return scores.Variant(prefix=self.prefix, inter=dict(self.inter), intra=self.intra,
                            num_tokens=self.num_tokens, prefix_num_tokens=dict(self.prefix_num_tokens),
                            access_count=self.access_count, f_r=self.f_r)


class PinCounts:
    """Nested pins per variant id, held in process memory (choice 4); the owning store's lock guards it.

    Unlike the K/V tiers' PinTable (store/base.py), an unbalanced unpin raises: the metadata stores'
    callers pin and unpin in one place (FusionEngine), so an imbalance is a bug to surface.
    """

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self._counts)

    def count(self, variant_id: str) -> int:
        return self._counts.get(variant_id, 0)

    def add(self, variant_id: str) -> None:
        self._counts[variant_id] = self.count(variant_id) + 1

    def release(self, variant_id: str) -> None:
        """Undo one pin; StoreError when the variant is not pinned."""
        count = self.count(variant_id)
        if count == 0:
            raise StoreError(f"unpin({variant_id!r}): not pinned")
        if count == 1:
            del self._counts[variant_id]
        else:
            self._counts[variant_id] = count - 1

    def check_unpinned(self, variant_id: str) -> None:
        """StoreError when the variant is pinned (`remove` refuses it)."""
        if self.count(variant_id):
            raise StoreError(f"remove({variant_id!r}): pinned {self.count(variant_id)} time(s)")

    def clear(self) -> None:
        self._counts.clear()


class WaitBudget:
    """Seconds one request may spend in calls on a busy metadata store, all of them together (a meta.sqlite
    locked by another process). A backend that waits for locks (SQLite) charges every call made inside its
    `waiting_within(budget)` and refuses one once the budget is spent; see `waiting_within` below."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.spent = 0.0

    def left_s(self) -> float:
        return self.seconds - self.spent

    def charge(self, seconds: float) -> None:
        self.spent += max(seconds, 0.0)


def waiting_within(store: object, budget: WaitBudget | None) -> contextlib.AbstractContextManager:
    """The store's calls inside the block bounded by `budget` (None: the store's own waits). A backend
    without lock waits (Redis: every call is bounded by its socket timeout and outage backoff) runs as is."""
    bound = getattr(store, "waiting_within", None)
    return contextlib.nullcontext() if budget is None or bound is None else bound(budget)


@runtime_checkable
class MetaStore(Protocol):
    """The variant metadata contract (module docstring, choices 1-7); SQLite and Redis implement it."""

    max_variants: int
    policy: str
    unreadable_rows: int

    def put(self, record: VariantRecord) -> list[VariantRecord]: ...

    def get(self, variant_id: str) -> VariantRecord | None: ...

    def variants(self, chunk_key: str) -> list[VariantRecord]: ...

    def choose(self, chunk_key: str, new_prefix: Sequence[str],
               alpha: float) -> tuple[VariantRecord, float] | None: ...

    def record_use(self, variant_id: str, cfo: float, eps: float = 1e-6) -> VariantRecord | None: ...

    def record_uses(self, uses: Sequence[tuple[str, float]], eps: float = 1e-6) -> int: ...

    def remove(self, variant_id: str) -> VariantRecord | None: ...

    def pin(self, variant_id: str) -> None: ...

    def pin_many(self, variant_ids: Sequence[str]) -> list[str]: ...

    def unpin(self, variant_id: str) -> None: ...

    def pin_count(self, variant_id: str) -> int: ...

    def count(self) -> int: ...

    def all_records(self) -> list[VariantRecord]: ...

    def variant_versions(self) -> list[tuple[str, tuple]]: ...

    def get_many(self, variant_ids: Sequence[str]) -> list[VariantRecord]: ...

    def size_by_tier(self) -> dict[str, int]: ...

    def generation(self) -> int: ...

    def close(self) -> None: ...


def record_to_dict(record: VariantRecord) -> dict:
    """A plain dict of the record's constructor fields (JSON- and pickle-safe; derived fields left out)."""
    data = {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.init}
    data["prefix"], data["ranked_tokens"] = list(record.prefix), list(record.ranked_tokens)
    return data


def record_from_dict(data: dict) -> VariantRecord:
    """The inverse of record_to_dict (validates like the constructor)."""
    return VariantRecord(**data)

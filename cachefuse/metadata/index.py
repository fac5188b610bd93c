"""Which stored variant each declared chunk of a prompt reuses: an in-memory index of variant metadata.

Imports only the standard library, cachefuse.chunks (torch-free) and cachefuse.metadata.{base, scores}:
the vLLM scheduler plans with it inside `schedule()` (no tensors, no I/O; the index is filled at start-up
and kept current by the worker's reports and by cachefuse.metadata.refresher's `IndexRefresher`, a
background thread), and the reference engine plans with it over its own metadata store.

Rules (docs/variants.md):

1. A declared chunk's new prefix is the ordered chunk keys of the declared non-system chunks before it
   (the system prompt is shared by every prompt and is not context that distinguishes variants), the
   nearest `max_variant_prefix_chunks` of them.
2. Among the chunk's variants the lowest CFO wins (scores.choose_variant; ties to the closer prefix).
3. A K/V entry stored under the plain chunk key without a metadata row (a store written before the
   metadata store, or by another tool) is a base variant without statistics: prefix (), CCI 0.5.
4. Admission (`Admission`): a chunk whose best CFO is >= `min_cfo` is not loaded: it is computed in
   full in the prompt and stored as a new variant for its prefix, at most `max_chunks` such chunks per
   prompt, the highest CFO first (ties: the earlier chunk, whose shorter prefix more later prompts
   contain). Chunks with no variant at all are computed anyway and do not count. None: no admission.
5. A system chunk always reuses its base variant (it never moves, so its K/V are exact). Its key is
   `chunk_key(..., at_prompt_start=True)`: only an entry computed at the prompt's start, after nothing,
   is ever found under it, never the same text computed after other tokens.
6. Where a chosen variant's K/V are (`VariantChoice.tiers`, what the loading controller prices): its
   record's `tier` (the home tier, where a saved variant persists), and the tier a listing found its
   store key in (the scheduler lists the local disk tier). Residency in the worker's memory tier is not
   known here (an LRU cache the worker fills and empties without telling), so it is never claimed.
7. Exact places: a declared non-system chunk with a variant whose `exact_after` equals the hash of the
   prompt's tokens before the chunk (`chunks.place_hashes`) reuses that variant as exact: CFO 0, never a
   candidate for admission, and none of its rows a candidate for the selector (like the system chunk);
   it wins over every other variant of the chunk.
8. Default variant (`default_variant`, config). Where rule 2 picks the base variant (prefix ()) for a chunk
   whose new prefix is not empty (so the base variant is not stored for this prefix), "base" keeps it and
   "fused" (the default) loads the chunk's best neighbour-fused variant instead (`neighbour_fused`: stored
   by the offline neighbour step), by rule 2's order among those (FusionRAG's fused cache, used wherever
   the chunk appears); none: the base variant. A variant saved from a served request's hole never
   qualifies here (it was computed after whatever chunks that request held); it still competes under
   rule 2. Its CFO is its own Cache-Craft score. An exact place (rule 7), a variant rule 2 prefers to the
   base one, and the base variant of a chunk with nothing before it (exact there) are chosen as under
   "base"; in a store without neighbour-fused variants "fused" plans exactly as "base".
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cachefuse.chunks import is_candidate_chunk
from cachefuse.metadata import scores
from cachefuse.metadata.base import VariantRecord, variant_store_key


@dataclass(frozen=True)
class VariantChoice:
    """The variant one declared chunk reuses, and what the selector needs from its metadata."""

    chunk_key: str
    store_key: str
    """Key of its K/V entry in the K/V tiers (metastore choice 7)."""
    variant_id: str
    cfo: float
    """Cache Fix Overhead of this variant after the prompt's prefix (scores.cfo)."""
    ranked_tokens: tuple[int, ...] = ()
    """Offsets within the chunk, most contextualised first; empty: no ranking."""
    has_metadata: bool = True
    """False for rule 3's entries (no metadata row: no f_r to update)."""
    tiers: tuple[str, ...] = ()
    """Tiers known to hold its K/V (rule 6); empty: unknown."""
    exact: bool = False
    """Rule 7: its K/V were computed after exactly the tokens before it in this prompt, by a full prefill:
    reused as is, no row of it recomputed (never set for the system chunk, exact by its key)."""


@dataclass(frozen=True)
class Admission:
    """Rule 4's policy: which stored chunks a prompt computes in full to store them for its prefix."""

    min_cfo: float
    """A chunk whose best variant scores CFO >= this is a candidate."""
    max_chunks: int | None = None
    """Candidates admitted per prompt, the highest CFO first; None: all of them."""

    @classmethod
    def from_config(cls, config) -> Admission | None:
        """From a CacheFuseConfig's resolved `admission_cfo` and `variant_admission_max_chunks`."""
        min_cfo = config.admission_cfo
        return None if min_cfo is None else cls(min_cfo, config.variant_admission_max_chunks)


def new_prefixes(chunk_keys: Sequence[str], is_system: Sequence[bool],
                 max_chunks: int | None = None) -> list[tuple[str, ...]]:
    """Rule 1: each declared chunk's prefix, the non-system declared chunks before it, in order; the
    nearest `max_chunks` of them when given (None: all)."""
    prefixes, seen = [], []
    for key, system in zip(chunk_keys, is_system, strict=True):
        prefixes.append(tuple(seen if max_chunks is None else seen[max(0, len(seen) - max_chunks):]))
        if not system:
            seen.append(key)
    return prefixes


class VariantIndex:
    """chunk key -> its variants' metadata (insertion order), plus plain K/V keys without metadata.

    Two writers (the scheduler, with what the worker reports, and `IndexRefresher`'s thread) change it
    under one lock; readers never take it: every change replaces whole per-chunk lists, and
    `replace_all` swaps the dicts in one assignment.

    What the worker announces (`announce`: saved behind the response, written moments later) outlives
    a snapshot that does not hold it yet: a reload taken while the writer is still behind must not
    forget a variant the next request can load. An announced variant leaves that state when a snapshot
    holds it, when the worker reports it gone (`remove`), or at the first snapshot read after the
    worker reported it written (`confirm_written`; that snapshot is then the truth, e.g. another
    engine evicted it). A removal also outlives a snapshot read before it (`snapshot_started`).

    Args:
        records: variant metadata.
        plain_keys: K/V keys known to exist (rule 3), found in `plain_tier` (None: a tier not known).
    """

    def __init__(self, records: Iterable[VariantRecord] = (), plain_keys: Iterable[str] = (),
                 plain_tier: str | None = None) -> None:
        self._lock = threading.Lock()
        self._by_chunk: dict[str, list[VariantRecord]] = {}
        self._plain: dict[str, str | None] = dict.fromkeys(plain_keys, plain_tier)  # key -> tier listed in
        self._announced: dict[str, VariantRecord] = {}  # variant id -> record no snapshot has held yet
        self._announced_plain: set[str] = set()  # K/V keys no listing has held yet
        self._removed: set[str] | None = None  # variant ids removed since the running snapshot was read
        self._written: set[str] = set()  # announced K/V keys the worker has since written
        self._expiring: set[str] = set()  # written before the running snapshot was read: it decides
        for record in records:
            self._add(record)

    def __contains__(self, chunk_key: object) -> bool:
        return isinstance(chunk_key, str) and self.has(chunk_key)

    def __len__(self) -> int:
        return sum(len(records) for records in self._by_chunk.values())

    def records(self) -> list[VariantRecord]:
        with self._lock:  # another thread's announce or remove may change the chunks meanwhile
            return [record for records in self._by_chunk.values() for record in records]

    def variants(self, chunk_key: str) -> list[VariantRecord]:
        return list(self._by_chunk.get(chunk_key, ()))

    def has(self, chunk_key: str) -> bool:
        """True when the chunk has any variant (a metadata row or a plain K/V entry)."""
        return chunk_key in self._by_chunk or chunk_key in self._plain

    def add(self, record: VariantRecord) -> None:
        """Add or replace (same variant id) one variant; an upsert keeps its place."""
        with self._lock:
            self._add(record)

    def announce(self, records: Iterable[VariantRecord], plain_keys: Iterable[str] = ()) -> None:
        """Variants and K/V keys the worker saved (or queued for its writer): added, and kept across
        reloads until a snapshot holds them."""
        with self._lock:
            for record in records:
                self._add(record)
                self._announced[record.variant_id] = record
                if self._removed is not None:
                    self._removed.discard(record.variant_id)
            for key in plain_keys:
                self._plain.setdefault(key, None)
                self._announced_plain.add(key)

    def _add(self, record: VariantRecord) -> None:
        records = list(self._by_chunk.get(record.chunk_key, ()))
        for i, old in enumerate(records):
            if old.variant_id == record.variant_id:
                records[i] = record
                break
        else:
            records.append(record)
        self._by_chunk[record.chunk_key] = records

    def add_plain_keys(self, keys: Iterable[str], tier: str | None = None) -> None:
        """K/V keys known to exist, in `tier` (None: not known; a tier already known for a key stays)."""
        with self._lock:
            for key in keys:
                if tier is not None or key not in self._plain:
                    self._plain[key] = tier

    def remove(self, variant_id: str) -> None:
        """Forget a variant (evicted, or found stale by the worker); also its plain K/V key."""
        with self._lock:
            if self._removed is not None:
                self._removed.add(variant_id)
            gone = self._announced.pop(variant_id, None)
            if gone is not None:
                self._announced_plain.discard(gone.store_key)
                # kept for the next snapshot's verdict; with the variant gone there is none to give (and
                # without a refresher nothing else would ever drop it)
                self._written.discard(gone.store_key)
                self._expiring.discard(gone.store_key)
            self._remove(variant_id)

    def _remove(self, variant_id: str) -> None:
        for chunk, records in list(self._by_chunk.items()):
            kept = [r for r in records if r.variant_id != variant_id]
            if len(kept) != len(records):
                for gone in records:
                    if gone.variant_id == variant_id:
                        self._plain.pop(gone.store_key, None)
                if kept:
                    self._by_chunk[chunk] = kept
                else:
                    del self._by_chunk[chunk]
                return

    def confirm_written(self, store_keys: Iterable[str]) -> None:
        """The worker wrote these announced K/V keys: the next snapshot read decides whether they stay."""
        with self._lock:
            announced = self._announced_plain | {r.store_key for r in self._announced.values()}
            self._written.update(key for key in store_keys if key in announced)

    def snapshot_started(self) -> None:
        """The refresher is about to read a snapshot: removals from now on are applied on top of it,
        and announcements written before now are left to it."""
        with self._lock:
            self._removed = set()
            self._expiring, self._written = self._expiring | self._written, set()  # | a failed read's

    def replace_all(self, records: Iterable[VariantRecord], plain_keys: Iterable[str] | None = None,
                    plain_tier: str | None = None) -> None:
        """Swap in a fresh snapshot (the refresher's reload); `plain_keys` None keeps the known ones.
        Announced variants the snapshot lacks are kept, variants removed since `snapshot_started` are
        dropped from it."""
        fresh = VariantIndex()
        with self._lock:
            removed, expiring = self._removed or set(), self._expiring
            for record in records:
                if record.variant_id not in removed:
                    fresh._add(record)
                    self._announced.pop(record.variant_id, None)  # the snapshot holds it
            for variant_id, record in list(self._announced.items()):
                if record.store_key in expiring:
                    del self._announced[variant_id]  # written before the snapshot was read, not in it: gone
                else:
                    fresh._add(record)
            if plain_keys is None:
                fresh._plain = dict(self._plain)
                self._announced_plain -= expiring
            else:
                fresh._plain = dict.fromkeys(plain_keys, plain_tier)
                self._announced_plain -= fresh._plain.keys() | expiring
                for key in self._announced_plain:
                    fresh._plain.setdefault(key, None)
            self._by_chunk, self._plain = fresh._by_chunk, fresh._plain
            self._removed, self._expiring = None, set()

    def choose(self, chunk_key: str, new_prefix: Sequence[str], alpha: float, num_tokens: int,
               place: str | None = None, default_variant: str = "fused") -> VariantChoice | None:
        """Rules 2-3, 7 and 8: the variant to reuse after `new_prefix`, or None when the chunk has none; the
        one computed exactly at `place` (chunks.place_hash of the tokens before it), when there is one."""
        records = self._by_chunk.get(chunk_key)
        if records and place is not None:
            for record in records:
                if record.exact_after == place:
                    return VariantChoice(chunk_key, record.store_key, record.variant_id, 0.0,
                                         record.ranked_tokens, True, self._tiers_of(record, True), exact=True)
        if not records:
            if chunk_key not in self._plain:
                return None
            records = [VariantRecord.without_stats(chunk_key, (), num_tokens)]
            has_metadata = False
        else:
            has_metadata = True
        variants = [r.to_variant() for r in records]
        index, cfo = scores.choose_variant(variants, new_prefix, alpha)
        if default_variant == "fused" and new_prefix and not records[index].prefix:
            fused = [i for i, r in enumerate(records) if r.neighbour_fused and r.prefix]
            if fused:
                best, cfo = scores.choose_variant([variants[i] for i in fused], new_prefix, alpha)
                index = fused[best]
        record = records[index]
        return VariantChoice(chunk_key, record.store_key, record.variant_id, cfo,
                             record.ranked_tokens, has_metadata, self._tiers_of(record, has_metadata))

    def _tiers_of(self, record: VariantRecord, has_metadata: bool) -> tuple[str, ...]:
        """Rule 6: the record's home tier (a real record only) and the tier its key was listed in."""
        tiers = [record.tier] if has_metadata else []
        listed = self._plain.get(record.store_key)
        if listed is not None and listed not in tiers:
            tiers.append(listed)
        return tuple(tiers)


def plan_variants(index: VariantIndex, chunk_keys: Sequence[str], is_system: Sequence[bool],
                  lengths: Sequence[int], alpha: float, admission: Admission | None = None,
                  max_prefix_chunks: int | None = None, places: Sequence[str] | None = None,
                  default_variant: str = "fused") -> list[VariantChoice | None]:
    """One prompt's choices, per declared chunk in prompt order (None: computed in full, rules 1-5, 7-8).

    `places`: per declared chunk, chunks.place_hashes of the prompt at its start (None: no chunk is
    recognised as exact, rule 7). `default_variant`: rule 8.

    Cost: for each chunk, every variant of it is scored against a prefix of at most `max_prefix_chunks`
    keys (the order penalty is quadratic in that), so a prompt costs O(chunks x variants per chunk x
    max_prefix_chunks^2) with no term growing with the index's size.
    """
    choices: list[VariantChoice | None] = []
    candidates: list[int] = []  # rule 4
    prefixes = new_prefixes(chunk_keys, is_system, max_prefix_chunks)
    places = [None] * len(chunk_keys) if places is None else places
    for key, system, prefix, length, place in zip(chunk_keys, is_system, prefixes, lengths, places, strict=True):
        choice = index.choose(key, () if system else prefix, alpha, length, None if system else place,
                              default_variant)
        if (choice is not None and is_candidate_chunk(system, choice.exact) and admission is not None
                and choice.cfo >= admission.min_cfo and choice.store_key != variant_store_key(key, prefix)):
            candidates.append(len(choices))
        choices.append(choice)
    candidates.sort(key=lambda i: (-choices[i].cfo, i))
    for i in candidates[:admission.max_chunks if admission is not None else 0]:
        choices[i] = None  # compute it in full; it becomes the variant for this prefix
    return choices

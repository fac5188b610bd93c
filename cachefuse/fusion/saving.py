"""Hole saves: the chunks a fused pass computed (its holes) stored as variants.

Imports torch, cachefuse.{chunks, fusion.plan, metadata.base, ops, select.qcfuse, store.base}; never
vllm. The engine turns a pass's holes into `HoleSave`s (RoPE-stripped K/V copied out of the pass,
`extract_chunk_kv`, and the variant's metadata row); `HoleWriter` writes one: K/V first, then the row,
so a reader never sees a row whose K/V are not there yet, evicting the metadata store's victims
(N x M budget) with their K/V. Every stored entry carries QCFuse's key-norm anchors. Writing behind the
request, off its path, is cachefuse.fusion.background_saver's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cachefuse import ops
from cachefuse.chunks import Segment, place_hashes
from cachefuse.errors import StoreError
from cachefuse.fusion.plan import FuseResult
from cachefuse.metadata.base import MetaStore, VariantRecord, make_variant_id
from cachefuse.rope import RopeSpec
from cachefuse.select.qcfuse import ANCHORS_META, choose_anchors, with_anchors
from cachefuse.store.base import ChunkKV, KVStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)  # identity: queue lookups never compare tensors
class HoleSave:
    """One hole, ready to be written: its K/V entry and its variant's metadata row."""

    store_key: str
    record: VariantRecord
    entry: ChunkKV
    ready: Any = None
    """A CUDA event recorded after `entry` was copied out of the pass: the writer thread waits on it
    before reading the tensors (None on CPU)."""


@dataclass
class SaveReport:
    """What saving did, for the request's figures and the scheduler's index."""

    saved_keys: list[str] = field(default_factory=list)
    """Store keys written (queued, for a background saver)."""
    records: list[VariantRecord] = field(default_factory=list)
    """Metadata rows written (queued), for the scheduler's index."""
    evicted: list[str] = field(default_factory=list)
    """Variant ids gone: evicted to admit a hole, or announced queued and then not saved."""
    failures: int = 0
    """Holes the store or the metadata store refused (full of pinned entries, unwritable, unreachable)."""
    skipped: int = 0
    """Holes not saved because the background writer's queue was full."""
    written: list[str] = field(default_factory=list)
    """Store keys the background writer finished writing (announced earlier under `saved_keys`)."""

    def add(self, other: SaveReport) -> None:
        self.saved_keys += other.saved_keys
        self.records += other.records
        self.evicted += other.evicted
        self.failures += other.failures
        self.skipped += other.skipped
        self.written += other.written

    def is_empty(self) -> bool:
        return not (self.saved_keys or self.records or self.evicted or self.failures or self.skipped
                    or self.written)


@dataclass(frozen=True)
class HolePlaces:
    """Where a pass's holes sit, for their records' `exact_after` (metastore choice 8)."""

    token_ids: Sequence[int]
    """The pass's prompt."""
    exact_end: int
    """Rows [0, exact_end) hold a full prefill's K/V at every layer (`exact_rows_end`)."""


def exact_rows_end(result: FuseResult, segments: Sequence[Segment], exact_loaded: set[int]) -> int:
    """The first row of the pass whose K/V may differ from a full prefill's (the prompt's length if none).

    A row is exact when it was loaded exact (`exact_loaded`: the system chunk, a chunk reused at its exact
    place) or computed at every layer (holes, undeclared tokens, and loaded rows a selector recomputed at
    every layer) over rows before it that are all exact. A row computed at a layer after attending to a
    loaded approximate row is not: the first row neither loaded exact nor computed everywhere ends the run.

    ```
    | system (exact) | A (exact place) | hole: exact | B (approximate) | hole: NOT exact |
    0                                               ^ exact_end
    ```
    """
    num_tokens = segments[-1].end if segments else 0
    selective = [rows for rows in result.rows_per_layer if rows is not None]
    device = selective[0].device if selective else "cpu"  # on the pass's device: one read back, at the end
    everywhere = torch.ones(num_tokens, dtype=torch.bool, device=device)
    for rows in selective:
        computed = torch.zeros(num_tokens, dtype=torch.bool, device=device)
        computed[rows] = True
        everywhere &= computed
    for index in exact_loaded:
        everywhere[segments[index].start:segments[index].end] = True
    inexact = (~everywhere).nonzero()
    return int(inexact[0]) if inexact.numel() else num_tokens


def hole_saves(result: FuseResult, segments: list[Segment], keys: dict[int, str], meta_keys: dict[int, str],
               ratio: float, rope_spec: RopeSpec, max_prefix_chunks: int,
               places: HolePlaces | None = None, *, neighbour_segment: int | None = None) -> list[HoleSave]:
    """Every hole of `result` as the variant for its prefix (metadata.index rule 1: the declared non-system
    chunks before it, in prompt order, the nearest `max_prefix_chunks`); a hole with no such prefix is
    the chunk's base variant, stored under the plain chunk key. A hole after other chunks whose prefix
    `max_prefix_chunks` cuts to nothing (0) is not saved: under the plain key it would pass for the base
    variant, computed after the system prompt alone. A hole whose every earlier row is exact
    (`places.exact_end`) records its place (`exact_after`); the others, and every hole without `places`,
    record none and are never reused as exact. The hole of segment `neighbour_segment` (the offline
    neighbour step's chunk; None on every served pass) is marked `neighbour_fused` when it has a prefix."""
    saves = []
    # NOTE: hashed here rather than taken from planning: in vLLM the plan's place hashes are the scheduler
    # process's (the worker is handed the variants chosen, not the hashes), planning hashes only with
    # `exact_places` on while a save records its place either way, and one pass costs ~0.1 ms at 8K tokens.
    exact_starts = [] if places is None else [segments[i].start for i in result.hole_segments
                                               if segments[i].start <= places.exact_end]
    exact_after = dict(zip(exact_starts, place_hashes(places.token_ids, exact_starts) if exact_starts else [],
                           strict=True))
    for index in result.hole_segments:
        prefix_ids = [i for i in sorted(keys) if i < index and not segments[i].is_system]
        if prefix_ids and max_prefix_chunks == 0:
            continue
        prefix_ids = prefix_ids[max(0, len(prefix_ids) - max_prefix_chunks):]
        prefix = tuple(meta_keys[i] for i in prefix_ids)
        store_key = keys[index] if not prefix else f"{keys[index]}-{make_variant_id(meta_keys[index], prefix)}"
        entry = extract_chunk_kv(result, segments[index], rope_spec,
                                 meta={"variant": "fused" if prefix else "base", "prefix": ",".join(prefix)})
        record = variant_record(result, index, prefix_ids, segments, meta_keys, ratio)
        if segments[index].start in exact_after:
            record = dataclasses.replace(record, exact_after=exact_after[segments[index].start])
        if index == neighbour_segment and prefix:
            record = dataclasses.replace(record, neighbour_fused=True)
        saves.append(HoleSave(store_key, record, entry, _copy_done_event(entry)))
    return saves


def with_key_norm_anchors(entry: ChunkKV, ratio: float, sink_tokens: int) -> ChunkKV:
    """The same tensors with QCFuse's key-norm anchors in the metadata (kept if the entry has anchors)."""
    if ANCHORS_META in entry.meta or entry.num_tokens == 0:
        return entry
    offsets = choose_anchors(entry, "key_norm", ratio, sink_tokens)
    return with_anchors(entry, offsets, "key_norm", ratio, sink_tokens)


def extract_chunk_kv(result: FuseResult, segment: Segment, rope_spec, meta: dict[str, str] | None = None) -> ChunkKV:
    """A segment's fused K/V as a storable entry: RoPE stripped at the segment's positions, copied.

    Raises:
        KeyError: the pass kept only the holes' K/V (FuseResult.hole_kv) and `segment` was not a hole.
    """
    if result.k:
        k_rows = [k[segment.start:segment.end] for k in result.k]
        v_rows = [v[segment.start:segment.end].clone() for v in result.v]
    else:
        k_rows, v_rows = result.hole_kv[segment.start]
    positions = torch.arange(segment.start, segment.end, dtype=torch.int64, device=k_rows[0].device)
    return ChunkKV(k_nope=[ops.strip_rope(k, positions, rope_spec) for k in k_rows], v=list(v_rows),
                   meta=dict(meta or {}))


def variant_record(result: FuseResult, index: int, prefix_ids: list[int], segments: list[Segment],
                   keys: dict[int, str], ratio: float) -> VariantRecord:
    """The hole's metadata, in cachefuse.metadata.scores.Variant's terms. With the pass's attention statistics:
    inter-attention to each prefix chunk, intra-attention, and the chunk's token offsets ranked by the
    inter-attention each pays to the prefix (recompute candidates, most contextualised first; ties by
    offset). Without them, a record without statistics."""
    key, seg = keys[index], segments[index]
    prefix = tuple(keys[i] for i in prefix_ids)
    lengths = {keys[i]: segments[i].length for i in prefix_ids}
    fused_ratio = float(ratio) if prefix else None
    token_mass = result.hole_token_mass.get(index)
    if token_mass is None:
        return VariantRecord.without_stats(key, prefix, seg.length, lengths, recompute_ratio=fused_ratio)
    mass = [sum(column) for column in zip(*token_mass, strict=True)]  # [segment], summed over tokens
    from_prefix = [sum(row[i] for i in prefix_ids) for row in token_mass]
    ranked = sorted(range(len(from_prefix)), key=lambda t: (-from_prefix[t], t))
    return VariantRecord(chunk_key=key, prefix=prefix, inter=_sum_by_key((keys[i], mass[i]) for i in prefix_ids),
                         intra=mass[index], num_tokens=seg.length, prefix_num_tokens=lengths,
                         ranked_tokens=tuple(ranked), recompute_ratio=fused_ratio)


def _sum_by_key(pairs) -> dict[str, float]:
    """A chunk repeated in the prefix pays its attention into one entry."""
    out: dict[str, float] = {}
    for key, value in pairs:
        out[key] = out.get(key, 0.0) + value
    return out


def _copy_done_event(entry: ChunkKV) -> Any:
    if not entry.k_nope or entry.k_nope[0].device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class HoleWriter:
    """Writes hole saves into a store and a metadata store (the worker owns both).

    Args:
        writes_metadata: False on tensor-parallel ranks other than 0 (rank 0 owns the rows; the others
            store their own K/V only).
        home_tier: the tier a saved variant persists in, for the row's `tier`.
    """

    def __init__(self, store: KVStore, metastore: MetaStore, writes_metadata: bool, home_tier: str,
                 anchors: tuple[float, int] | None = None) -> None:
        self.store, self.metastore = store, metastore
        self.writes_metadata, self.home_tier = writes_metadata, home_tier
        self.anchors = anchors
        """QCFuse's (anchor ratio, sink tokens): key-norm anchors join each entry's metadata as it is
        written, on the writer's thread, so a qcfuse request reads them instead of every layer's keys."""

    def stored_record(self, save: HoleSave) -> VariantRecord:
        """The row as written: the entry's size, and the tier it persists in."""
        return dataclasses.replace(save.record, size_bytes=save.entry.nbytes, tier=self.home_tier)

    def write(self, save: HoleSave) -> SaveReport:
        """K/V first, then the row; an existing pair is left alone. Never raises for a refusal: it is
        counted in the report's `failures` (and logged)."""
        key, store_key, variant_id = save.record.chunk_key, save.store_key, save.record.variant_id
        try:
            if self.store.contains(store_key) and (not self.writes_metadata
                                                   or self.metastore.get(variant_id) is not None):
                return SaveReport()
        except StoreError as exc:
            logger.warning("cachefuse: variant metadata unavailable (%s): hole %s not saved", exc, key)
            return SaveReport(failures=1)
        if save.ready is not None:
            save.ready.synchronize()
        entry = save.entry if self.anchors is None else with_key_norm_anchors(save.entry, *self.anchors)
        if not self.store.put(store_key, entry):
            return SaveReport(failures=1)
        record = self.stored_record(save)
        if not self.writes_metadata:
            return SaveReport(saved_keys=[store_key])
        try:
            victims = self.metastore.put(record)
        except StoreError as exc:  # full of pinned variants, or the metadata store is unreachable
            logger.warning("cachefuse: hole %s not admitted as a variant (%s)", key, exc)
            if not self._row_may_exist(variant_id):
                self.store.remove(store_key)
            return SaveReport(failures=1)
        for victim in victims:
            self.store.remove(victim.store_key)
        return SaveReport(saved_keys=[store_key], records=[record], evicted=[v.variant_id for v in victims])

    def _row_may_exist(self, variant_id: str) -> bool:
        """After a refused row: does one exist all the same? Another engine sharing the store may have
        written it (its K/V under the same key, which removing would leave its row pointing at nothing),
        or the put landed and only its reply was lost. Unknown (the store still failing) counts as yes: a
        K/V entry kept without a row costs budget until it ages out, one removed under a row is a miss
        for every engine until the variant is saved again."""
        try:
            return self.metastore.get(variant_id) is not None
        except StoreError:
            return True

    def record_uses(self, uses: Sequence[tuple[str, float]]) -> None:
        """Reuses of variants this writer has just written (deferred while they were queued)."""
        if not uses or not self.writes_metadata:
            return
        try:
            self.metastore.record_uses(uses)
        except StoreError as exc:
            logger.warning("cachefuse: reuse of %d queued variants not recorded (%s)", len(uses), exc)

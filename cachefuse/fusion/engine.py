"""FusionEngine: one fused prefill end to end over a ModelAdapter (keys -> store -> fusor -> save).

Imports cachefuse.{adapters.base, chunks, config, fusion.*, loading, metadata, select, store}; never vllm. The
reference engine (demo, benchmarks, eval, tests) is this class over adapters.hf; the vLLM connector's worker side runs the
same steps over its own adapter. Each declared chunk reuses the variant the metadata store scores
best for its prefix (cachefuse.metadata.index); holes are saved as the variant for their prefix.
With `preload_depth` >= 1 (or None) chunk K/V are fetched layer by
layer during the pass (docs/loading.md); a layer that misses mid-pass re-runs the pass with that
chunk as a hole.

```
| system (chunk 0) | chunk A (hit) | chunk B (miss: hole, saved) | question | last |
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cachefuse.adapters.base import ModelAdapter
from cachefuse.chunks import (
    KeyContext,
    Segment,
    chunk_key,
    is_candidate_chunk,
    place_hash,
    place_hashes,
    segment_prompt,
)
from cachefuse.config import CacheFuseConfig
from cachefuse.errors import StoreError
from cachefuse.fusion.background_saver import BackgroundSaver, PendingReadsStore, QueueDepth
from cachefuse.fusion.batch import START_LAYER, PassSteps, RankSum, run_alone
from cachefuse.fusion.fusor import Fusor
from cachefuse.fusion.plan import FusePlan, FuseRequest, FuseResult
from cachefuse.fusion.saving import (
    HolePlaces,
    HoleWriter,
    SaveReport,
    exact_rows_end,
    extract_chunk_kv,
    hole_saves,
    with_key_norm_anchors,
)
from cachefuse.fusion.stats import FusionStats, PassLoads, pass_stats
from cachefuse.loading.entries import EntryReader, LoadBudget, LoadFigures, keep_agreed_hits
from cachefuse.loading.loader import LayerUnavailable, store_layer_fetcher
from cachefuse.loading.probe_reads import StoreProbeReads, supports_probe_reads
from cachefuse.metadata.base import MetaStore, VariantRecord, WaitBudget, waiting_within
from cachefuse.metadata.index import Admission, VariantChoice, VariantIndex, plan_variants
from cachefuse.metadata.sqlite import SqliteMetaStore
from cachefuse.select.base import ChunkReuse, Selector
from cachefuse.select.full_prefill import FullPrefillSelector
from cachefuse.select.registry import make_selector
from cachefuse.store.base import ChunkKV, KVStore

logger = logging.getLogger(__name__)

DEFAULT_PRELOAD_DEPTH = 2
"""preload_depth=None's depth when no measured figures gave one (the controller's L_p, in the vLLM worker)."""


@dataclass(frozen=True)
class RankGroup:
    """What one tensor-parallel rank's engine needs of its group; the defaults are a single rank."""

    meta_key_context: KeyContext | None = None
    """The key context of metadata rows (rank 0's, so every rank plans with the same variants); K/V
    entries use the engine's own `key_context`. None: the engine's own."""
    writes_metadata: bool = True
    """False on ranks other than 0 (rank 0 owns the metadata rows; the others store and load K/V only)."""
    size: int = 1
    """Ranks in the tensor-parallel group."""
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None
    """An all-reduce (sum) over the ranks (None: one rank). Passes never call it: they yield RankSum ops
    (cachefuse.fusion.batch) that the batch runs through it, after the ranks' agreement that no pass of
    the batch failed. Every rank scores only its own heads, and the sums make all ranks pick the same rows;
    the ranks agree on the hits before the pass, so loading is serial (every miss known before the first
    layer): ranks that disagree on a hit would recompute different rows and their collectives deadlock."""


class FusionEngine:
    """Looks up declared chunks, fuses, and saves holes as new entries.

    Args:
        adapter: the model.
        store: where chunk caches live (read, and written for holes and precompute).
        key_context: model fingerprint, KV dtype, TP layout and config hash for chunk keys.
        config: selector, ratio and fusor settings.
        clock: time source for blend_time_s (injectable so tests never depend on wall time).
        metastore: the variant metadata (default: an in-memory SQLite store of config.max_variants).
        ranks: this rank's place in a tensor-parallel group (None: a single rank).
    """

    def __init__(self, adapter: ModelAdapter, store: KVStore, key_context: KeyContext,
                 config: CacheFuseConfig, clock: Callable[[], float] = time.perf_counter,
                 metastore: MetaStore | None = None, ranks: RankGroup | None = None) -> None:
        self.adapter, self.store, self.key_context, self.config = adapter, store, key_context, config
        config.check_model(adapter.shape.num_layers)
        ranks = RankGroup() if ranks is None else ranks
        self.meta_key_context = ranks.meta_key_context or key_context
        self.writes_metadata = ranks.writes_metadata
        self.ranks = ranks
        self.metastore: MetaStore = metastore if metastore is not None else SqliteMetaStore(
            ":memory:", max_variants=config.max_variants, policy=config.eviction_policy)
        self.saver: BackgroundSaver | None = None
        self.fusor = Fusor(adapter, block_rows=config.attention_block_rows, sum_over_ranks=ranks.sum_over_ranks,
                           clock=clock)
        self.clock = clock

    def fusor_full_layers(self, selector: str) -> int:
        """How many leading layers `selector` computes in full on this model."""
        return make_selector(selector, self.config).num_full_layers(self.adapter.shape.num_layers)

    def key(self, token_ids: Sequence[int], *, at_prompt_start: bool = False) -> str:
        """This rank's key of a chunk (`at_prompt_start`: the system chunk, computed after nothing)."""
        return chunk_key(token_ids, self.key_context, at_prompt_start=at_prompt_start)

    def meta_key(self, token_ids: Sequence[int], *, at_prompt_start: bool = False) -> str:
        """The chunk's key in the metadata (rank 0's under tensor parallelism)."""
        return chunk_key(token_ids, self.meta_key_context, at_prompt_start=at_prompt_start)

    def own_store_key(self, own_key: str, choice: VariantChoice) -> str:
        """This rank's K/V key of the chosen variant: its own chunk key, plus the variant id unless base."""
        return own_key if choice.store_key == choice.chunk_key else f"{own_key}-{choice.variant_id}"

    # ------------------------------------------------------------------ precompute

    def compute_chunk(self, chunk_ids: Sequence[int], prefix_ids: Sequence[int] = ()) -> ChunkKV:
        """A chunk's RoPE-stripped K/V computed after `prefix_ids` alone (full prefill)."""
        ids = torch.tensor([*prefix_ids, *chunk_ids], dtype=torch.int64, device=self.adapter.device)
        segments = [Segment(len(prefix_ids), len(chunk_ids), is_chunk=True, is_system=not prefix_ids)]
        if prefix_ids:
            segments.insert(0, Segment(0, len(prefix_ids), is_chunk=False, is_system=False))
        result = self.fusor.fuse(FuseRequest(ids, segments, {}, 1.0), FullPrefillSelector())
        return extract_chunk_kv(result, segments[-1], self.adapter.rope_spec, meta={"variant": "base"})

    def precompute(self, chunks: Sequence[Sequence[int]], prefix_ids: Sequence[int] = (),
                   annotate: Callable[[Sequence[int], ChunkKV], ChunkKV] | None = None) -> list[str]:
        """Stores each chunk's base variant (computed after `prefix_ids`, e.g. the system prompt); with
        no `prefix_ids`, each chunk's entry as a system chunk (computed at the prompt's start).
        Each entry carries QCFuse's key-norm anchors, unless `annotate(chunk_ids, entry)` returns the entry
        to store instead (e.g. attention-ranked anchors, cachefuse.offline.anchors.anchor_annotator)."""
        keys = []
        for chunk_ids in chunks:
            key = self.key(chunk_ids, at_prompt_start=not prefix_ids)
            if not self.store.contains(key):
                entry = self.compute_chunk(chunk_ids, prefix_ids)
                entry = annotate(chunk_ids, entry) if annotate is not None else with_key_norm_anchors(
                    entry, *self._anchors())
                if self.store.put(key, entry):  # a full prefill after exactly `prefix_ids`: exact there
                    record = VariantRecord.without_stats(key, (), len(chunk_ids), size_bytes=entry.nbytes,
                                                         tier=self._home_tier(), exact_after=place_hash(prefix_ids))
                    for victim in self.metastore.put(record):
                        self.store.remove(victim.store_key)
            keys.append(key)
        return keys

    # ------------------------------------------------------------------ variants

    def plan_variants(self, token_ids: Sequence[int],
                      chunks: Sequence[Sequence[int]]) -> list[VariantChoice | None]:
        """Which variant each declared chunk reuses (cachefuse.metadata.index rules), from this engine's
        metadata store; the vLLM scheduler makes the same choice from its in-process index."""
        segments = [s for s in segment_prompt(len(token_ids), chunks) if s.is_chunk]
        keys = [self.meta_key(token_ids[s.start:s.end], at_prompt_start=s.is_system) for s in segments]
        return self._plan_variants(token_ids, segments, keys)

    def _plan_variants(self, token_ids: Sequence[int], segments: Sequence[Segment], meta_keys: Sequence[str],
                       wait: WaitBudget | None = None, budget: LoadBudget | None = None) -> list[VariantChoice | None]:
        """`plan_variants` of the declared `segments` of `token_ids` whose metadata keys are `meta_keys`, the
        metadata store's calls within `wait` (a chunk whose call is refused is a miss), the store calls within
        `budget` (the prefill's load budget; None: unbounded)."""
        budget = LoadBudget(None) if budget is None else budget
        index = VariantIndex()
        queued: dict[str, list[VariantRecord]] = {}  # rows a background save has not written yet
        for record in [] if self.saver is None else self.saver.pending_records():
            queued.setdefault(record.chunk_key, []).append(record)
        for key in dict.fromkeys(meta_keys):
            try:
                with budget.bounding(self.clock), waiting_within(self.metastore, wait):
                    records = self.metastore.variants(key)
            except StoreError as exc:
                logger.warning("cachefuse: variant metadata unavailable (%s): chunk %s is a miss", exc, key)
                continue
            known = {r.variant_id for r in records}
            records += [r for r in queued.get(key, ()) if r.variant_id not in known]
            for record in records:
                index.add(record)
            if not records and self.key_context == self.meta_key_context:
                with budget.bounding(self.clock):
                    stored = self.store.contains(key)
                if stored:
                    index.add_plain_keys([key])
        return plan_variants(index, list(meta_keys), [s.is_system for s in segments], [s.length for s in segments],
                             self.config.cachecraft_alpha, Admission.from_config(self.config),
                             self.config.max_variant_prefix_chunks,
                             place_hashes(token_ids, [s.start for s in segments]) if self.config.exact_places
                             else None, self.config.default_variant)

    # ------------------------------------------------------------------ fused prefill

    def prefill(self, token_ids: Sequence[int], chunks: Sequence[Sequence[int]],
                selector: str | Selector | None = None, ratio: float | None = None,
                **plan_fields: Any) -> tuple[FuseResult, FusionStats]:
        """Fuses one prompt whose declared chunks are `chunks` ([start, end) offsets): `fuse` of the
        FusePlan of these, the config's selector and ratio where not given, and any other FusePlan field
        (`save_holes`, `variants`, `preload_depth`, `save_inline`, `neighbour_variant`, `record_uses`,
        `attention_backend`)."""
        return self.fuse(FusePlan(
            token_ids=token_ids, segments=segment_prompt(len(token_ids), chunks),
            selector=selector or self.config.selector,
            ratio=self.config.recompute_ratio if ratio is None else ratio, **plan_fields))

    def fuse(self, plan: FusePlan) -> tuple[FuseResult, FusionStats]:
        """Runs one fused prefill: variants (the plan's, or chosen here), load, blend pass, hole saves."""
        return run_alone(self.fuse_steps(plan), self.fusor.execute_ops)

    def fuse_steps(self, plan: FusePlan) -> PassSteps:
        """`fuse` as a generator of its pass's ops (cachefuse.fusion.batch), returning (result, stats): the
        vLLM worker batches several requests' passes and splits them across engine steps. Closed early (an
        abort), it unpins what it pinned and stops its loader thread; nothing is saved or recorded."""
        selector = make_selector(plan.selector, self.config) if isinstance(plan.selector, str) else plan.selector
        token_ids, segments = plan.token_ids, list(plan.segments)
        ids = torch.tensor(list(token_ids), dtype=torch.int64, device=self.adapter.device)
        chunk_indices = [i for i, s in enumerate(segments) if s.is_chunk]
        keys, meta_keys = self._chunk_keys(plan, chunk_indices)
        wait = None if self.config.metadata_wait_s is None else WaitBudget(self.config.metadata_wait_s)
        budget = LoadBudget(self.config.load_timeout_s)  # this prefill's store time, whoever shares the step
        choices = plan.variants
        if choices is None:
            choices = self._plan_variants(token_ids, [segments[i] for i in chunk_indices],
                                          [meta_keys[i] for i in chunk_indices], wait, budget)
        if len(choices) != len(chunk_indices):
            raise ValueError(f"{len(choices)} variant choices for {len(chunk_indices)} declared chunks")
        chosen = {i: c for i, c in zip(chunk_indices, choices, strict=True) if c is not None}
        load_keys = {i: self.own_store_key(keys[i], c) for i, c in chosen.items()}
        reuse = {i: ChunkReuse(c.cfo, c.ranked_tokens, c.variant_id, c.exact) for i, c in chosen.items()}
        start = self.clock()
        figures = LoadFigures()
        miss_reasons = Counter({"not_stored": len(chunk_indices) - len(chosen)})
        pinned_variants = self._pinned_variants(chosen.values(), wait, budget)
        with self.store.pinned(list(load_keys.values())), pinned_variants as metadata_ok:
            if not metadata_ok:  # unpinned, an entry is read whole before the first layer: an eviction
                plan = dataclasses.replace(plan, preload_depth=0)  # meanwhile is a miss, never a pass dropped
            result, loaded, more_misses, bytes_loaded = yield from self._fuse(
                ids, segments, load_keys, plan, selector, figures, reuse, budget)
        miss_reasons += more_misses
        blend_time = self.clock() - start
        if metadata_ok and plan.record_uses:  # else the store has just failed: its timeout is not paid again
            self._record_uses(chosen, loaded, wait, budget)
        exact_loaded = {i for i in loaded if not is_candidate_chunk(segments[i].is_system, reuse[i].exact)}
        saved = (self._save_holes(plan, result, segments, keys, meta_keys, exact_loaded,
                                  None if plan.save_inline else wait)
                 if plan.save_holes else SaveReport())
        stats = pass_stats(selector.name, plan.ratio, segments, chunk_indices, result, PassLoads(
            loaded=loaded, load_keys=load_keys, choices=list(choices), figures=figures, miss_reasons=miss_reasons,
            bytes_loaded=bytes_loaded), saved, blend_time)
        return result, stats

    def _chunk_keys(self, plan: FusePlan, chunk_indices: list[int]) -> tuple[dict[int, str], dict[int, str]]:
        """(this rank's K/V key, metadata key) of each declared chunk by segment index. The metadata keys
        are the plan's when its caller hashed them (the vLLM scheduler, in rank 0's key context); a rank's
        own keys are hashed here only where its key context differs (tensor-parallel ranks other than 0)."""
        token_ids, segments = plan.token_ids, plan.segments

        def hashed(key_of: Callable[..., str]) -> dict[int, str]:
            return {i: key_of(token_ids[segments[i].start:segments[i].end], at_prompt_start=segments[i].is_system)
                    for i in chunk_indices}

        if plan.meta_keys is None:
            meta_keys = hashed(self.meta_key)
        elif len(plan.meta_keys) != len(chunk_indices):
            raise ValueError(f"{len(plan.meta_keys)} chunk keys for {len(chunk_indices)} declared chunks")
        else:
            meta_keys = dict(zip(chunk_indices, plan.meta_keys, strict=True))
        keys = meta_keys if self.key_context == self.meta_key_context else hashed(self.key)
        return keys, meta_keys

    @contextlib.contextmanager
    def _pinned_variants(self, choices: Iterable[VariantChoice], wait: WaitBudget | None, budget: LoadBudget):
        """Pins the chosen variants' metadata for the pass (an eviction must not pick them meanwhile); yields
        whether the metadata store answered within `wait` and what is left of the load `budget`. One call for all of them (`pin_many`): a stalled
        Redis costs its whole timeout per call, and one call per chunk (up to `max_chunks_per_request`)
        would hold the step for minutes. Unpinned, a variant may be evicted meanwhile: the caller then
        reads entries whole before the pass, so its K/V load decides (a miss, then a hole)."""
        pinned, answered = [], True
        wanted = [c.variant_id for c in choices if c.has_metadata] if self.writes_metadata else []
        try:
            if wanted:
                try:  # one call: a variant gone since planning is skipped, its K/V load decides
                    with budget.bounding(self.clock), waiting_within(self.metastore, wait):
                        pinned = self.metastore.pin_many(wanted)
                except StoreError as exc:
                    logger.warning("cachefuse: variant metadata unavailable (%s): this request pins and "
                                   "records no variants", exc)
                    answered = False
            yield answered
        finally:
            for variant_id in pinned:
                self.metastore.unpin(variant_id)

    def _record_uses(self, chosen: dict[int, VariantChoice], loaded: dict, wait: WaitBudget | None,
                     budget: LoadBudget) -> None:
        """f_r += 1/CFO for every variant reused, in one metadata transaction, within `wait` and what is left
        of the load `budget` (spent: not sent, the reuses not recorded). A chosen variant whose K/V
        turned out missing keeps its row (`cachefuse inspect` lists it as stale): the hole computed
        instead is saved as the variant for this prefix, a re-save of the same pair restores it, and an
        unused row has the lowest f_r."""
        if not self.writes_metadata:
            return
        uses = [(c.variant_id, c.cfo) for i, c in chosen.items() if i in loaded and c.has_metadata]
        if self.saver is not None:  # a variant still queued for writing has no row yet: counted once it has
            uses = self.saver.defer_uses(uses)
        if not uses:
            return
        try:
            with budget.bounding(self.clock), waiting_within(self.metastore, wait):
                self.metastore.record_uses(uses)
        except StoreError as exc:
            logger.warning("cachefuse: reuse of %d variants not recorded (%s)", len(uses), exc)

    def _fuse(self, ids: torch.Tensor, segments: list[Segment], keys: dict[int, str], plan: FusePlan,
              selector: Selector, figures: LoadFigures, reuse: dict[int, ChunkReuse], budget: LoadBudget
              ) -> PassSteps:
        """One blend pass (a generator of its ops): entries read whole first (preload_depth 0) or fetched layer by layer.

        A pipelined pass whose fetch misses mid-pass (LayerUnavailable) cannot turn the layers already
        computed into a hole, so it is dropped: the miss is counted under its reason and the pass re-runs
        serially with that key's segments as holes (the output equals a store without that chunk).

        Returns:
            the result, the loaded segments (index -> entry or key), misses by reason, bytes loaded.
        """
        depth = self.config.preload_depth if plan.preload_depth is None else plan.preload_depth
        depth = DEFAULT_PRELOAD_DEPTH if depth is None else depth
        if self.ranks.sum_over_ranks is not None:
            depth = 0  # serial: every miss is known before the first layer (RankGroup.sum_over_ranks)
        probes = selector.probe_spec(self.adapter.shape.num_layers) is not None
        if probes and not supports_probe_reads(self.store):
            depth = 0  # the question probe reads whole entries before the pass starts
        if depth == 0:
            reader = self._reader(budget)
            loaded, miss_reasons = reader.read(segments, keys, figures)
            if self.ranks.sum_over_ranks is not None and keys:  # the ranks agree on the hits (a RankSum op)
                indices = sorted(keys)
                hits = torch.tensor([float(i in loaded) for i in indices], device=ids.device)
                counts = (yield RankSum(hits, START_LAYER)).tolist()
                keep_agreed_hits(loaded, miss_reasons, indices, counts, self.ranks.size)
            result = yield from self._fuse_whole(ids, segments, loaded, plan, selector, reuse)
            return result, loaded, miss_reasons, sum(entry.nbytes for entry in loaded.values())
        miss_reasons = Counter()
        fetched = {}
        reader = self._reader(budget)
        for index, key in keys.items():
            if reader.present(key, miss_reasons):
                fetched[index] = key
        fetched_keys = list(dict.fromkeys(fetched.values()))
        fetch = reader.timed(store_layer_fetcher(self.store, fetched_keys), figures, fetched_keys)
        # A query-aware selector's probe reads its view and score-layer keys first, straight from the
        # store (counted in bytes_loaded); the pass then fetches every layer.
        probe_reads = StoreProbeReads(self.store, fetched, self.adapter.shape.num_layers, reader) if probes else None
        request = FuseRequest(ids, segments, {}, plan.ratio, fetch_layer=fetch, fetched=fetched,
                              preload_depth=depth, reuse=reuse,
                              collect_attention_stats=self.config.gathers_attention_stats,  # callers may swap config
                              probe_source=probe_reads, attention_backend=plan.attention_backend)
        try:
            result = yield from self.fusor.fuse_steps(request, selector)
            probe_bytes = 0 if probe_reads is None else probe_reads.bytes_read
            return result, fetched, miss_reasons, sum(figures.bytes.values()) + probe_bytes
        except LayerUnavailable as exc:
            logger.warning("chunk %s missed at layer %d mid-pass (%s): re-running the pass with it as a hole",
                           exc.key, exc.layer, exc.reason)
            missed = exc
        return (yield from self._fuse_without(missed, ids, segments, keys, plan, selector, figures, reuse, budget))

    def _fuse_without(self, missed: LayerUnavailable, ids: torch.Tensor, segments: list[Segment],
                      keys: dict[int, str], plan: FusePlan, selector: Selector, figures: LoadFigures,
                      reuse: dict[int, ChunkReuse], budget: LoadBudget) -> PassSteps:
        """The pass again, serially, with the key that missed mid-pass as a hole (see `_fuse`)."""
        if missed.reason == "length_mismatch":
            self.store.remove(missed.key)  # as in EntryReader.read: the hole computed now replaces it
        figures.clear()
        reasons = Counter({missed.reason: sum(1 for key in keys.values() if key == missed.key)})
        rest = {index: key for index, key in keys.items() if key != missed.key}
        loaded, more = self._reader(budget).read(segments, rest, figures)
        result = yield from self._fuse_whole(ids, segments, loaded, plan, selector, reuse)
        return result, loaded, reasons + more, sum(entry.nbytes for entry in loaded.values())

    def _fuse_whole(self, ids: torch.Tensor, segments: list[Segment], loaded: dict[int, ChunkKV], plan: FusePlan,
                    selector: Selector, reuse: dict[int, ChunkReuse]) -> PassSteps:
        """The blend pass over entries read whole (`loaded`), in the pass's own thread."""
        return self.fusor.fuse_steps(FuseRequest(ids, segments, loaded, plan.ratio, reuse=reuse,
                                           collect_attention_stats=self.config.gathers_attention_stats,
                                           attention_backend=plan.attention_backend), selector)

    def _reader(self, budget: LoadBudget) -> EntryReader:
        """Reads from the engine's current store (`save_in_background` wraps it) on its clock, within
        `budget`, its prefill's load budget."""
        return EntryReader(self.store, self.adapter.shape.num_layers, self.clock, budget)

    def _save_holes(self, plan: FusePlan, result: FuseResult, segments: list[Segment], keys: dict[int, str],
                    meta_keys: dict[int, str], exact_loaded: set[int], wait: WaitBudget | None) -> SaveReport:
        """Stores every hole of `plan`'s pass as the variant for its prefix (cachefuse.fusion.saving), exact at
        its place when every row before it was (`exact_loaded`: the loaded segments whose K/V are exact), the
        last chunk's neighbour-fused when the plan is the offline neighbour step's: written now, or queued for
        the background saver (`save_in_background`), the request's path then only copying them out. Written
        now, the metadata calls wait within `wait` (None: `sync_save`, offline, waits as long as SQLite)."""
        # exact_rows_end reads every selective layer's rows: only for a pass that has holes to place
        places = (HolePlaces(plan.token_ids, exact_rows_end(result, segments, exact_loaded))
                  if result.hole_segments else None)
        neighbour_segment = max(i for i, s in enumerate(segments) if s.is_chunk) if plan.neighbour_variant else None
        saves = hole_saves(result, segments, keys, meta_keys, plan.ratio, self.adapter.rope_spec,
                           self.config.max_variant_prefix_chunks, places, neighbour_segment=neighbour_segment)
        if self.saver is not None and not plan.save_inline:
            return self.saver.submit(saves)
        writer = self._hole_writer() if self.saver is None else self.saver.writer
        report = SaveReport()
        for save in saves:
            with waiting_within(self.metastore, wait):
                report.add(writer.write(save))
        return report

    def _hole_writer(self) -> HoleWriter:
        """A writer into this engine's own store (before `save_in_background` wraps it, or without it)."""
        return HoleWriter(self.store, self.metastore, self.writes_metadata, self._home_tier(), self._anchors())

    def _anchors(self) -> tuple[float, int]:
        """QCFuse's anchor ratio and sink count: every stored entry carries its key-norm anchors."""
        return self.config.qcfuse_anchor_ratio, self.config.qcfuse_sink_tokens

    def save_in_background(self, max_bytes: int, flush_timeout_s: float = 30.0) -> None:
        """From now on holes are written by a BackgroundSaver whose queue holds at most `max_bytes`;
        queued holes read as stored meanwhile; `close` waits at most `flush_timeout_s` for the queue."""
        if self.saver is not None:
            raise RuntimeError("this engine already saves in the background")
        self.saver = BackgroundSaver(self._hole_writer(), max_bytes, flush_timeout_s)
        self.store = PendingReadsStore(self.store, self.saver)

    def save_queue_depth(self) -> QueueDepth | None:
        """The background saver's queue now; None when saving inline."""
        return None if self.saver is None else self.saver.queue_depth()

    def take_save_report(self) -> SaveReport:
        """What the background saver did since the last call (empty when saving inline)."""
        return SaveReport() if self.saver is None else self.saver.take_report()

    def close(self, timeout_s: float | None = None) -> int:
        """Flushes queued saves (within `timeout_s`, default the saver's); returns how many were left unwritten."""
        return 0 if self.saver is None else self.saver.close(timeout_s)

    def _home_tier(self) -> str:
        """The slowest tier's name (where a saved variant persists), for the metadata's `tier`."""
        tiers = getattr(self.store, "tiers", None)
        if tiers:
            return getattr(tiers[-1], "name", type(tiers[-1]).__name__)
        return getattr(self.store, "name", "store")

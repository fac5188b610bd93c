"""What travels between the connector's two halves, and the aggregate stats vLLM logs.

Scheduler -> worker: CacheFuseMetadata (one BlendPlan per request to fuse this step).
Worker -> scheduler: CacheFuseWorkerMeta (per-request figures, fallbacks, saved keys).
Both are plain dataclasses of lists and numbers: vLLM pickles them between processes every step.
Aggregate counters for vLLM's logging and Prometheus are in metrics.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from cachefuse.chunks import Segment, is_candidate_chunk
from cachefuse.loading.figures import ComputeFigures
from cachefuse.metadata.base import record_from_dict
from cachefuse.metadata.index import VariantChoice

NULL_BLOCK_ID = 0
"""vLLM's null block (BlockPool takes its first block as it): what a block table holds for blocks that no
attention will read, such as the blocks of a sliding-window model that fall out of every window. Shared by
every request: never written, never reported as a load error."""


@dataclass
class BlendPlan:
    """One request to fuse in this step's start_load_kv.

    ```
    | system | chunk | hole | chunk | question | last |
    0                                      N-1      N
    |<--------- written by cachefuse ------->| vLLM |
    ```
    """

    req_id: str
    token_ids: list[int]
    segments: tuple[Segment, ...]
    """The tiling of [0, N) the scheduler parsed (`FusionRequest.segments`): declared chunks and the ranges
    computed in full between them."""
    chunk_keys: tuple[str, ...]
    """Rank 0's store key of each declared chunk, in order (the keys the scheduler planned with)."""
    selector: str
    recompute_ratio: float
    slot_mapping: list[int]
    """Paged-cache slot of every prompt position 0..N-1 (block_id * block_size + offset)."""
    block_ids: list[int]
    """The request's blocks, covering positions 0..N-1."""
    error_block_ids: list[int]
    """The blocks covering cached_prefix_tokens..N-2 (cachefuse's hit): reported as load errors if the
    blend fails."""
    selected_rows: tuple[int, ...] | None = None
    preload_depth: int | None = None
    """The controller's L_p for this request (config preload_depth null); None: the config's."""
    variants: list[VariantChoice | None] | None = None
    """Per declared chunk, the variant to reuse (chosen by CFO from the scheduler's index; None in the
    list: computed in full). None: the worker plans from its own metadata store."""
    sync_save: bool = False
    """Write the holes before the response (the request asked, `cachefuse.sync_save`)."""
    neighbour_variant: bool = False
    """Save the last declared chunk's hole as a neighbour-fused variant (FusePlan.neighbour_variant): a
    `store_variant` request on an engine that allows offline jobs (`allow_sync_save`)."""
    replay: bool = False
    """The request's first blend ran before vLLM preempted it: this one rebuilds the same K/V and neither
    saves its holes again nor counts its reuses again (f_r)."""
    load_async: bool = False
    """vLLM holds the request in WAITING_FOR_REMOTE_KVS until the worker reports the blend done (or failed)
    in `get_finished`; the blend may run batched and across several steps (config blend_step_tokens). Its
    blocks may stop short of position N-1, which vLLM computes itself."""
    estimated_rows: float = 0.0
    """The pass's rows summed over its layers, as the scheduler estimated them (`estimated_rows`): what the
    worker's cohorts fit into its step budget."""
    cached_prefix_tokens: int = 0
    """Positions [0, P) are vLLM's own prefix-cache hit (block-aligned, exact, shared with other requests):
    the pass computes them in memory as ever, never writes their slots and never reads them (the request
    computing them may be in this very step, its forward after the blend: paged.unwritten_prefix).
    `error_block_ids` leaves their blocks out."""


def blend_budget_rows(blend_step_tokens: int | None, max_num_batched_tokens: int, num_layers: int) -> int:
    """The blend work of one engine step in pass rows: `blend_step_tokens` (None: vLLM's
    `max_num_batched_tokens`) x num_layers. The scheduler fits synchronous blends into it, the worker
    spends what they leave on the waiting ones."""
    tokens = max_num_batched_tokens if blend_step_tokens is None else blend_step_tokens
    return tokens * num_layers


def estimated_rows(num_tokens: int, segments: Sequence[Segment], variants: Sequence[Any] | None, ratio: float,
                   num_layers: int, num_full: int, probe_depth: int = 0,
                   figures: ComputeFigures | None = None) -> float:
    """Rows a blend pass computes, summed over its layers (the unit of `blend_step_tokens` x num_layers),
    before it runs: every row in the full layers; after them the rows not loaded (holes, question, glue)
    and the ratio's share of the loaded chunks neither system nor exact (VariantChoice.exact); and a
    query-aware selector's question probe, the rows not loaded through its `probe_depth` layers. Variants
    not planned (None list) count as loaded; a None in the list is a hole.

    With measured `figures` each layer is priced at what it costs (`ComputeFigures.row_equivalents`: in
    rows of a full layer), not at its row count: a layer of few rows still loads, rotates and merges every
    token's K/V, so a pass of selective layers alone (qcfuse) counted by rows was priced at about half its cost
    against one with full layers (cacheblend), and the budget let a step run twice the blend work it meant
    to. Without figures (none measured yet), rows as they are."""
    chunks = [s for s in segments if s.is_chunk]
    planned = list(variants) if variants is not None else [True] * len(chunks)
    loaded = [(s, v) for s, v in zip(chunks, planned, strict=False) if v is not None]
    candidates = sum(s.length for s, v in loaded
                     if is_candidate_chunk(s.is_system, getattr(v, "exact", False)))
    not_loaded = num_tokens - sum(s.length for s, _ in loaded)
    selective = min(not_loaded + ratio * candidates, num_tokens)

    def priced(rows: float) -> float:
        return rows if figures is None else figures.row_equivalents(rows, num_tokens)

    return (num_full * num_tokens + (num_layers - num_full) * priced(selective)
            + probe_depth * priced(not_loaded))


@dataclass
class CacheFuseMetadata(KVConnectorMetadata):
    plans: list[BlendPlan] = field(default_factory=list)
    plain_prefill_tokens: int = 0
    """When this step is nothing but plain (unfused) prefills: their tokens, so the worker can time
    vLLM's own prefill speed (the loading controller's go/no-go baseline). Else 0."""
    finished_req_ids: list[str] = field(default_factory=list)
    """Requests vLLM finished since the last step (aborts among them): a blend still running for one is
    stopped before it does more work."""
    first_tokens: int = 0
    """Requests this step computes the first token of after their asynchronous blend ended: the worker
    holds the waiting blends for the step, so those first tokens do not wait for the next cohort's blend
    (the step's forward and sampling come after its blend work)."""


@dataclass
class CacheFuseWorkerMeta(KVConnectorWorkerMetadata):
    request_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    """req_id -> the figures of its blend pass, or its fallback reason."""
    saved_keys: list[str] = field(default_factory=list)
    """Chunk keys the worker stored this step (the scheduler's index learns them)."""
    figures: dict[str, Any] | None = None
    """The worker's measured figures (tier bandwidth, blend and prefill speed), when they changed."""
    saved_variants: list[dict[str, Any]] = field(default_factory=list)
    """Metadata of variants stored this step (metastore.record_to_dict), for the scheduler's index."""
    evicted_variants: list[str] = field(default_factory=list)
    """Variant ids whose metadata the worker removed this step (N x M eviction, K/V found gone, or a
    background save announced earlier that then failed)."""
    save_failures: int = 0
    """Background hole saves that failed since the last step (counted apart from any request)."""
    written_keys: list[str] = field(default_factory=list)
    """Store keys announced in `saved_keys` earlier that the background writer has now written."""

    # The scheduler applies a step's saved variants before its evicted ones; announce and evict keep
    # the two lists disjoint, so the later event of the step wins: a variant evicted and then saved
    # again stays known, one announced and then refused is forgotten.

    def announce(self, saved_keys: list[str], records: list[dict[str, Any]]) -> None:
        """Variants (record_to_dict) and K/V keys saved (or queued for the writer) now."""
        self.saved_keys.extend(saved_keys)
        ids = {record_from_dict(data).variant_id for data in records}
        self.evicted_variants = [v for v in self.evicted_variants if v not in ids]
        self.saved_variants.extend(records)

    def evict(self, variant_ids: list[str]) -> None:
        """Variants gone now (evicted, found missing, or their announced save failed)."""
        ids = set(variant_ids)
        if not ids:
            return
        kept, gone_keys = [], set()
        for data in self.saved_variants:
            record = record_from_dict(data)
            if record.variant_id in ids:
                gone_keys.add(record.store_key)
            else:
                kept.append(data)
        self.saved_variants = kept
        self.saved_keys = [key for key in self.saved_keys if key not in gone_keys]
        self.evicted_variants.extend(variant_ids)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> CacheFuseWorkerMeta:
        """Merge across ranks: a fallback on any rank is the request's outcome (all ranks fall back)."""
        assert isinstance(other, CacheFuseWorkerMeta), type(other)
        merged = dict(self.request_stats)
        for req_id, stats in other.request_stats.items():
            if req_id not in merged or stats.get("fallback_reason"):
                merged[req_id] = stats
        return CacheFuseWorkerMeta(
            request_stats=merged, saved_keys=sorted(set(self.saved_keys) | set(other.saved_keys)),
            figures=self.figures or other.figures, saved_variants=self.saved_variants + other.saved_variants,
            evicted_variants=sorted(set(self.evicted_variants) | set(other.evicted_variants)),
            save_failures=self.save_failures + other.save_failures,
            written_keys=sorted(set(self.written_keys) | set(other.written_keys)))

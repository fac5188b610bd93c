"""What travels into and out of one blend pass: `FuseRequest` (a prompt, its segments and where its
chunks' K/V come from) and `FuseResult` (the fused K/V, logits and the pass's figures).

Imports torch, cachefuse.{chunks, fusion.probe (the probe's source protocol), loading.loader (the
per-layer fetch type), select.base, store.base}; never vllm. The fusor reads a FuseRequest and returns
a FuseResult; the engine builds the one and saves holes from the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from cachefuse.chunks import Segment
from cachefuse.fusion.probe import ProbeSource
from cachefuse.loading.loader import FetchLayer
from cachefuse.metadata.index import VariantChoice
from cachefuse.select.base import ChunkReuse, Selector
from cachefuse.store.base import ChunkKV


class AttentionBackend(Protocol):
    """Attention of a pass's rows over the merged K/V of a layer, exact per query (a token at position p
    never sees a key beyond p). `writes_kv` true: the backend keeps every layer's merged K/V itself, so
    the pass keeps only the holes' rows (FuseResult.hole_kv): 1 GiB per 8K tokens on Llama-3-8B would
    otherwise outlive the pass."""

    writes_kv: bool

    def causal(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Every row, causally: q [T, num_heads, head_dim] -> [T, num_heads, head_dim]."""
        ...

    def rows(self, layer: int, q: torch.Tensor, q_positions: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> torch.Tensor:
        """The rows at `q_positions` (sorted) over keys 0..T-1, each up to its own position."""
        ...


@dataclass
class FuseRequest:
    """One prompt to fuse."""

    token_ids: torch.Tensor
    """[num_tokens] int64, the whole prompt."""
    segments: Sequence[Segment]
    """Tile [0, num_tokens) (chunks.segment_prompt)."""
    loaded: Mapping[int, ChunkKV]
    """Segment index -> its stored K/V; a declared chunk absent here is a hole (computed in full)."""
    ratio: float
    """Recompute ratio over the candidate rows (docs/architecture.md, Definitions)."""
    fetch_layer: FetchLayer | None = None
    """Layer -> K/V of the chunks in `fetched` (loader.store_layer_fetcher), called for layers 0..L-1
    in order. A layer that misses raises loader.LayerUnavailable out of `fuse` (the caller re-runs)."""
    fetched: Mapping[int, str] = field(default_factory=dict)
    """Segment index -> chunk key served by `fetch_layer`; loaded like `loaded`, one layer at a time."""
    preload_depth: int = 1
    """Layers `fetch_layer` may run ahead on a loader thread; 0 fetches in the pass's own thread."""
    reuse: Mapping[int, ChunkReuse] = field(default_factory=dict)
    """Segment index -> the chosen variant's CFO and recompute ranking (SelectionContext.reuse)."""
    probe_source: ProbeSource | None = None
    """With `fetched`: where the question probe reads before selection (probe_reads.StoreProbeReads: the
    anchors' rows and the score layers' keys only); whole `loaded` entries need none."""
    collect_attention_stats: bool = False
    """Gather each hole's attention mass per segment (FuseResult.hole_token_mass): one extra softmax
    pass over the holes' rows, for the statistics a saved variant carries."""
    attention_backend: AttentionBackend | None = None
    """Replaces the fusor's own attention for this request (None: torch / Triton attention over the
    merged K/V). The vLLM worker gives one that writes each layer's merged K/V into the request's slots
    of vLLM's paged cache as the layer attends (cachefuse.vllm.paged)."""


@dataclass
class FuseResult:
    k: list[torch.Tensor]
    """Per layer [num_tokens, num_kv_heads, head_dim], rotated at positions 0..num_tokens-1. Empty when the
    attention backend wrote every layer into its own cache (`writes_kv`): then only `hole_kv` is kept."""
    v: list[torch.Tensor]
    """Per layer [num_tokens, num_kv_heads, head_dim] (empty as `k`)."""
    logits: torch.Tensor
    """[vocab_size] fp32 at the last prompt position."""
    rows_per_layer: list[torch.Tensor | None]
    """Rows computed at each layer (None: every row)."""
    num_candidates: int
    num_selected: int
    """Candidate rows recomputed after the last selection."""
    num_forced: int
    """Holes, undeclared tokens, question and last token (computed in every layer)."""
    hole_segments: list[int] = field(default_factory=list)
    layer_seconds: list[float] = field(default_factory=list)
    """Time of each layer of the pass (Fusor.clock), the samples of the compute figures."""
    hole_token_mass: dict[int, list[list[float]]] = field(default_factory=dict)
    """With FuseRequest.collect_attention_stats: hole segment index -> [token][segment] attention mass each
    of its tokens puts on each segment, averaged over heads and layers."""
    probe_seconds: float = 0.0
    """Time of the question probe before the pass (query-aware selectors; Fusor.clock), else 0."""
    probe_layers: int = 0
    """Layers the probe ran (0: no probe)."""
    probe_rows: int = 0
    """Rows the probe computed at each of its layers (the forced rows)."""
    hole_kv: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=dict)
    """With a backend that writes K/V (`k` and `v` empty): hole segment start -> per layer (K, V) of its rows,
    copied: what saving reads, instead of every layer's whole prompt kept to the end of the pass."""

    @property
    def hole_attention(self) -> dict[int, list[float]]:
        """Per hole, the mass its rows put on each segment (summed over its tokens; Cache-Craft's
        inter/intra attention)."""
        return {h: [sum(column) for column in zip(*rows, strict=True)] for h, rows in self.hole_token_mass.items()}


@dataclass(frozen=True)
class FusePlan:
    """One fused prefill as FusionEngine.fuse runs it: the prompt, its segments (computed once, where the
    request was parsed), its chunk keys when the caller hashed them already, and how to fuse and save.

    ```
    | system (chunk 0) | chunk A | chunk B | question | last |     segments tile [0, N)
    ```
    """

    token_ids: Sequence[int]
    segments: Sequence[Segment]
    """Tile [0, len(token_ids)) (chunks.segment_prompt); the declared chunks are those with is_chunk."""
    selector: str | Selector
    """A registry name (built from the engine's config) or a ready Selector."""
    ratio: float
    meta_keys: Sequence[str] | None = None
    """Per declared chunk, in order, its metadata key (rank 0's: the vLLM scheduler's plan carries the
    keys it hashed); None: the engine hashes them."""
    variants: Sequence[VariantChoice | None] | None = None
    """Per declared chunk, the variant to reuse (None in the list: computed in full); None: chosen by the
    engine from its metadata store (FusionEngine.plan_variants)."""
    preload_depth: int | None = None
    """Overrides the config's (the loading controller's L_p for this request)."""
    save_holes: bool = True
    save_inline: bool = False
    """Write the holes before returning even when the engine saves in the background."""
    neighbour_variant: bool = False
    """The offline neighbour step's pass (cachefuse.offline): the last declared chunk's hole is saved as a
    neighbour-fused variant (VariantRecord.neighbour_fused), the other holes as usual. Never set for a
    served request."""
    record_uses: bool = True
    """False leaves the reused variants' f_r alone (a blend replayed after a preemption counted them)."""
    attention_backend: AttentionBackend | None = None
    """FuseRequest.attention_backend for this prefill's pass."""

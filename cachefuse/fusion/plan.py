"""What travels into and out of one blend pass: `FuseRequest` (a prompt, its segments and where its
chunks' K/V come from) and `FuseResult` (the fused K/V, logits and the pass's figures).

Imports torch, cachefuse.{chunks, fusion.probe (the probe's source protocol), loading.loader (the
per-layer fetch type), select.base, store.base}; never vllm. The fusor reads a FuseRequest and returns
a FuseResult; the engine builds the one and saves holes from the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from cachefuse.chunks import Segment
from cachefuse.fusion.probe import ProbeSource
from cachefuse.loading.loader import FetchLayer
from cachefuse.select.base import ChunkReuse
from cachefuse.store.base import ChunkKV


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

"""Selector protocol: how many leading layers run in full, and which cached rows are recomputed.

Imports only torch and cachefuse.chunks. A selector picks among *candidate* rows: cached tokens of
the declared non-system chunks not reused as exact (docs/architecture.md, Definitions: the recompute ratio
counts only these; a chunk whose variant was computed after exactly the tokens before it is exact).
Forced rows (holes, undeclared tokens, the question, the last token) are added by the fusor on top
and never pass through a selector. Before the pass, `estimate_rows` says how many rows a selector will
pick, from what the scheduler knows (each chunk's length and chosen variant's CFO): the loading
controller prices that, not ratio x tokens.

```
| system (loaded, never a candidate) | chunk A (candidates) | hole (forced) | question (forced) |
```
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from cachefuse.chunks import Segment


@dataclass(frozen=True)
class ChunkReuse:
    """What the variant metadata says about one loaded chunk's chosen variant (Cache-Craft)."""

    cfo: float
    """The chosen variant's CFO for this prompt: the fraction of the chunk's tokens to recompute."""
    ranked_tokens: tuple[int, ...] = ()
    """Offsets within the chunk, most contextualised first (Eq. 14); empty: the variant has no ranking."""
    variant_id: str = ""
    exact: bool = False
    """Its K/V were computed after exactly the tokens before it in this prompt (VariantChoice.exact): like
    the system chunk, it is no candidate, so no selector spends a row on it."""


@dataclass(frozen=True)
class SelectionContext:
    """What a selector may look at; built once per request by the fusor."""

    num_tokens: int
    num_layers: int
    segments: tuple[Segment, ...]
    candidate_rows: torch.Tensor
    """Sorted int64 indices of cached rows of declared non-system chunks not reused as exact."""
    candidate_segments: tuple[Segment, ...]
    """The loaded chunk segments neither system nor exact, in prompt order (their rows are the candidates)."""
    ratio: float
    reuse: Mapping[int, ChunkReuse] = field(default_factory=dict)
    """Segment index -> the chosen variant's CFO and ranking, for loaded chunks the metadata knows."""
    probe_scores: torch.Tensor | None = None
    """[num_candidates] fp32 aligned with `candidate_rows`: the question probe's score of each candidate
    (cachefuse.fusion.probe), set before `initial_rows` when the selector asks for a probe; else None."""
    probe_layer_scores: Mapping[int, torch.Tensor] | None = None
    """Score layer -> that layer's share of `probe_scores`, when the probe spec asks `per_layer`."""

    @property
    def device(self) -> torch.device:
        """The model's device: every tensor a selector returns lives here."""
        return self.candidate_rows.device


@dataclass(frozen=True)
class CheckLayerKV:
    """Fresh and loaded K/V of the candidate rows computed at a check layer (K before RoPE)."""

    rows: torch.Tensor
    """Sorted int64 candidate rows [R]."""
    fresh_k_nope: torch.Tensor  # [R, num_kv_heads, head_dim]
    fresh_v: torch.Tensor  # [R, num_kv_heads, head_dim]
    loaded_k_nope: torch.Tensor  # [R, num_kv_heads, head_dim]
    loaded_v: torch.Tensor  # [R, num_kv_heads, head_dim]


@dataclass(frozen=True)
class ProbeSpec:
    """What a query-aware selector asks of the question probe (cachefuse.fusion.probe) before the blend pass."""

    score_layers: tuple[int, ...]
    """Sorted distinct layers (0-based) at which the question's attention scores the context."""
    anchors_only: bool = False
    """The probe attends over the system chunk and each chunk's anchors only (QCFuse); False: every
    loaded row (FusionRAG, ProphetKV)."""
    question_only: bool = False
    """The probe attends over the system chunk alone, no retrieved chunk's row (a context-free,
    query-only probe: QCFuse's reading of FusionRAG, the demo's QCLast); the scored keys are still every
    loaded row's. Overrides `anchors_only`."""
    per_layer: bool = False
    """Also keep each score layer's scores apart (`SelectionContext.probe_layer_scores`): layer profiling."""

    @property
    def depth(self) -> int:
        """Layers the probe runs: up to and including the deepest score layer."""
        return self.score_layers[-1] + 1


@dataclass(frozen=True)
class PlannedChunk:
    """A loaded chunk, neither system nor exact, as planned before the pass (no tensors: the scheduler
    builds it)."""

    num_tokens: int
    """Its cached tokens, every one a candidate (a declared chunk ends before the prompt's last token)."""
    cfo: float | None = None
    """The chosen variant's CFO for this prompt (ChunkReuse.cfo); None: no variant metadata."""


@dataclass(frozen=True)
class RowEstimate:
    """Candidate rows a selector will recompute at a selective layer: `num_planned_rows` whatever the
    ratio, plus ceil(ratio x `num_ratio_candidates`) (cachefuse.loading.controller.RequestShape)."""

    num_planned_rows: int
    num_ratio_candidates: int


def num_rows_for_ratio(ratio: float, num_candidates: int) -> int:
    """ceil(ratio * n) with a guard against 0.15 * 100 = 15.000000000000002 style rounding up."""
    return min(num_candidates, math.ceil(ratio * num_candidates - 1e-9))


class Selector(ABC):
    """One instance per request. Static selectors pick once; check-layer selectors pick by deviation."""

    name: str = ""

    @abstractmethod
    def num_full_layers(self, num_layers: int) -> int:
        """How many leading layers compute every row."""

    def estimate_rows(self, chunks: Sequence[PlannedChunk], num_layers: int) -> RowEstimate:
        """The rows this selector will pick per selective layer over `chunks` (on average over a model's
        `num_layers`' selective layers), before the pass.

        The default is a ratio-driven selector (random): ceil(ratio x every candidate).
        """
        return RowEstimate(0, sum(chunk.num_tokens for chunk in chunks))

    def check_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers after whose K/V the fusor calls `select_at_check` (deviation-driven selectors)."""
        return ()

    def initial_rows(self, ctx: SelectionContext) -> torch.Tensor | None:
        """Candidate rows for the first selective layer, or None to wait for a check layer."""
        return None

    def check_partials(self, ctx: SelectionContext, check_index: int, kv: CheckLayerKV) -> torch.Tensor | None:
        """The per-row scores `select_at_check` needs from this rank's heads (K/V hold only them under
        tensor parallelism), or None when it needs none. The fusor sums them over the ranks (a RankSum op of
        the pass: no selector code runs a collective) and hands the sum to `select_at_check`."""
        return None

    def select_at_check(self, ctx: SelectionContext, check_index: int, kv: CheckLayerKV,
                        summed: torch.Tensor | None = None) -> torch.Tensor:
        """Sorted subset of the candidate rows `kv.rows` for the layers after check layer `check_index`;
        `summed`: `check_partials` summed over the ranks (None: computed here, on one rank's K/V)."""
        raise NotImplementedError(f"{self.name} has no check layers")

    def probe_spec(self, num_layers: int) -> ProbeSpec | None:
        """The question probe this selector needs before the pass (query-aware selectors), or None."""
        return None

    def probe_anchor_partials(self, segment: Segment, k_nope: Sequence[torch.Tensor]) -> torch.Tensor:
        """Under tensor parallelism: this rank's per-token anchor scores of a loaded chunk (its K holds only
        this rank's heads), which the fusor sums over the ranks (a RankSum op) and hands to `probe_anchors`."""
        raise NotImplementedError(f"{self.name} probes no anchors")

    def probe_anchors(self, segment: Segment, k_nope: Sequence[torch.Tensor], meta: Mapping[str, str],
                      summed: torch.Tensor | None = None) -> torch.Tensor:
        """Sorted chunk-local offsets of a loaded chunk's anchors, for a probe with `anchors_only`; `summed`:
        `probe_anchor_partials` summed over the ranks (None: one rank)."""
        raise NotImplementedError(f"{self.name} probes no anchors")

    def tracks_question_attention(self) -> bool:
        """Whether the fusor computes the question's attention per segment and calls `after_layer`."""
        return False

    def after_layer(self, ctx: SelectionContext, layer: int, question_mass: torch.Tensor) -> torch.Tensor | None:
        """Called after each layer's K/V merge but the last's, when `tracks_question_attention()`.

        At a check layer, or the last full layer, that selection wins and a returned tensor is ignored.

        Args:
            layer: the layer just merged (0-based).
            question_mass: [num_segments] fp32, the attention mass the question rows put on each
                segment at `layer` (summed over question rows, averaged over heads).

        Returns:
            None to keep the selection, or a sorted subset of the currently selected candidate rows,
            recomputed in the layers after `layer`.
        """
        return None


class ProbeSelector(Selector):
    """A query-aware selector: the question probe scores every candidate before the pass, then one
    global top-k at the ratio is recomputed through every layer (no full layers)."""

    def num_full_layers(self, num_layers: int) -> int:
        return 0

    def initial_rows(self, ctx: SelectionContext) -> torch.Tensor:
        count = num_rows_for_ratio(ctx.ratio, ctx.candidate_rows.numel())
        if count == ctx.candidate_rows.numel():
            return ctx.candidate_rows
        assert ctx.probe_scores is not None, f"{self.name}: the fusor ran no probe"
        top = torch.topk(ctx.probe_scores, count, sorted=False).indices
        return ctx.candidate_rows[top].sort().values


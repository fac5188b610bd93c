"""cacheblend: HKVD selection with gradual filtering (CacheBlend, EuroSys'25, section 4.3).

Choices the paper leaves open, decided here and documented
in docs/selectors.md:
- Layers 0..c0 run in full, c0 = the first check layer (>= 1: layer-0 K/V cannot deviate).
- Deviation = squared L2 of fresh minus loaded K (before RoPE: rotation preserves the norm), V, or
  both ("kv", each normalised by its mean square over the compared rows so neither dominates),
  summed over heads and head_dim.
- At check layer j the set keeps ceil(ratio * m_j * candidates) rows, m_j non-increasing and ending
  at 1.0, so the set after the last check layer is exactly the recompute ratio and the sets nest.
- Percentages count cached rows of declared non-system chunks; holes and question are on top.
- `sink_tokens` (default 0): the first tokens of each loaded chunk are kept at every check layer
  ahead of any deviation, within the same budget (measured in docs/selectors.md). Where the sinks
  (with the chunk floors) alone exceed the budget, which of them are kept is torch.topk's choice among
  equal scores, not the first tokens first.
- `chunk_floor` (default 0.0): each loaded chunk keeps at least that fraction of its proportional
  share of a check layer's rows, its own highest-deviation rows, so that one chunk whose rows all
  deviate a little is not starved by another that deviates a lot; the rest of the budget is global.
"""

import math
from collections.abc import Sequence

import torch

from cachefuse import ops
from cachefuse.select.base import (
    CheckLayerKV,
    PlannedChunk,
    RowEstimate,
    SelectionContext,
    Selector,
    num_rows_for_ratio,
)


def deviation_partials(kv: CheckLayerKV, metric: str) -> torch.Tensor:
    """This rank's squared distances, fp32: [R] for metric "k" or "v", [2, R] (K's, V's) for "kv".

    Each tensor pair's reduction is `ops.row_sq_dist` (a Triton kernel on CUDA, its twin
    cachefuse.deviation.row_sq_dist elsewhere), summed over this rank's heads: summed over the
    tensor-parallel ranks they are the distances over every head (K's and V's in one reduction).
    """
    if metric == "k":
        return ops.row_sq_dist(kv.fresh_k_nope, kv.loaded_k_nope)
    if metric == "v":
        return ops.row_sq_dist(kv.fresh_v, kv.loaded_v)
    return torch.stack([ops.row_sq_dist(kv.fresh_k_nope, kv.loaded_k_nope), ops.row_sq_dist(kv.fresh_v, kv.loaded_v)])


def deviation_from_sums(summed: torch.Tensor, metric: str) -> torch.Tensor:
    """Per-row deviation [R] from `deviation_partials` summed over the ranks: "kv" normalises K's and V's
    each by its mean so neither dominates."""
    if metric in ("k", "v"):
        return _damaged_first(summed)
    dev_k, dev_v = summed
    return _damaged_first(dev_k / _finite_mean(dev_k) + dev_v / _finite_mean(dev_v))


def kv_deviation(kv: CheckLayerKV, metric: str) -> torch.Tensor:
    """Per-row deviation [R] between fresh and loaded K/V over the heads `kv` holds (one rank's: all)."""
    return deviation_from_sums(deviation_partials(kv, metric), metric)


def _finite_mean(dev: torch.Tensor) -> torch.Tensor:
    """The mean of the finite deviations (at least 1e-30): one non-finite row (a damaged or overflowed
    entry) made the plain mean infinite, every other row's normalised score 0, and the ranking arbitrary."""
    finite = torch.isfinite(dev)
    return (torch.where(finite, dev, 0.0).sum() / finite.sum().clamp_min(1)).clamp_min(1e-30)


def _damaged_first(dev: torch.Tensor) -> torch.Tensor:
    """NaN deviations (a damaged entry) rank with the infinite ones, first: those rows are recomputed."""
    return torch.nan_to_num(dev, nan=float("inf"))


class CacheBlendSelector(Selector):
    name = "cacheblend"

    def __init__(
        self,
        check_layers: tuple[int, ...] = (1,),
        ratio_schedule: tuple[float, ...] = (1.0,),
        deviation: str = "v",
        sink_tokens: int = 0,
        chunk_floor: float = 0.0,
    ) -> None:
        assert len(check_layers) == len(ratio_schedule) and check_layers[0] >= 1, (check_layers, ratio_schedule)
        self._check_layers = check_layers
        self.ratio_schedule = ratio_schedule
        self.deviation = deviation
        self.sink_tokens = sink_tokens
        self.chunk_floor = chunk_floor

    def num_full_layers(self, num_layers: int) -> int:
        return min(self._check_layers[0] + 1, num_layers)

    def check_layers(self, num_layers: int) -> tuple[int, ...]:
        return tuple(layer for layer in self._check_layers if layer < num_layers)

    def estimate_rows(self, chunks: Sequence[PlannedChunk], num_layers: int) -> RowEstimate:
        """ceil(ratio x m x candidates) rows, m the schedule's multiplier averaged over the selective
        layers: with gradual filtering the layers between the first check layers compute m_j x ratio
        (layer l > c_0 keeps the set of the last check layer before it), so pricing them at the ratio
        alone would underestimate the pass. Per layer the set is capped at every candidate; the
        estimate is not (it prices a schedule above 1/ratio high)."""
        candidates = sum(chunk.num_tokens for chunk in chunks)
        checks = self.check_layers(num_layers)
        selective = range(self.num_full_layers(num_layers), num_layers)
        if not checks or not selective:
            return RowEstimate(0, candidates)
        multipliers = [self.ratio_schedule[max(j for j, c in enumerate(checks) if c < layer)] for layer in selective]
        return RowEstimate(0, math.ceil(candidates * sum(multipliers) / len(multipliers) - 1e-9))

    def _count(self, ctx: SelectionContext, check_index: int, kv: CheckLayerKV) -> int:
        target = num_rows_for_ratio(ctx.ratio * self.ratio_schedule[check_index], ctx.candidate_rows.numel())
        return min(target, kv.rows.numel())

    def check_partials(self, ctx: SelectionContext, check_index: int, kv: CheckLayerKV) -> torch.Tensor | None:
        if self._count(ctx, check_index, kv) == kv.rows.numel():
            return None  # every row is kept: no deviation to rank
        return deviation_partials(kv, self.deviation)

    def select_at_check(self, ctx: SelectionContext, check_index: int, kv: CheckLayerKV,
                        summed: torch.Tensor | None = None) -> torch.Tensor:
        count = self._count(ctx, check_index, kv)
        if count == kv.rows.numel():
            return kv.rows
        deviation = (kv_deviation(kv, self.deviation) if summed is None
                     else deviation_from_sums(summed, self.deviation))
        forced = torch.zeros(kv.rows.numel(), dtype=torch.bool, device=ctx.device)
        if self.sink_tokens:
            sinks = torch.cat([torch.arange(seg.start, min(seg.end, seg.start + self.sink_tokens), device=ctx.device)
                               for seg in ctx.candidate_segments]
                              or [torch.zeros(0, dtype=torch.int64, device=ctx.device)])
            forced |= torch.isin(kv.rows, sinks)
        if self.chunk_floor:
            forced |= self._chunk_floors(ctx, kv.rows, deviation, count)
        # NOTE: top-k stays torch.topk: one library call over [R] scores, already a fused kernel on CUDA.
        top = torch.topk(deviation.masked_fill(forced, float("inf")), count, sorted=False).indices
        return kv.rows[top].sort().values

    def _chunk_floors(self, ctx: SelectionContext, rows: torch.Tensor, deviation: torch.Tensor,
                      count: int) -> torch.Tensor:
        """Mask over `rows`: each chunk's floor(chunk_floor x count x its share of the candidates) rows
        of highest deviation. Rounded down, the floors sum to at most chunk_floor x count <= count."""
        forced = torch.zeros(rows.numel(), dtype=torch.bool, device=ctx.device)
        total = ctx.candidate_rows.numel()
        for seg in ctx.candidate_segments:
            inside = ((rows >= seg.start) & (rows < seg.end)).nonzero().flatten()
            floor = min(int(self.chunk_floor * count * (seg.end - seg.start) / total), inside.numel())
            if floor:
                forced[inside[torch.topk(deviation[inside], floor, sorted=False).indices]] = True
        return forced

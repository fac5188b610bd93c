"""Loading controller: recompute ratio, tier choice, preload depth and go/no-go per request.

Imports only the standard library, cachefuse.errors and cachefuse.loading.figures (the figures it
decides from); it runs in the scheduler: no torch, no vllm.
Follows CacheBlend section 5 (E8-E11: r = max(r*, r_match), the cheapest tier that adds no delay)
and Cache-Craft Eq. 16 / Algorithm 2 (preload depth). Everything is deterministic: figures, clocks
and measurements are injected; nothing here reads the wall clock.

Units: seconds, bytes, bytes/s. `ComputeFigures.layer_time` is one layer of the blend pass;
`recompute_time` and `load_time` are whole-request figures (all layers). Loading layer i+1 overlaps
computing layer i, so the fused TTFT is estimated as max(load, recompute) (the ideal pipeline; the
un-overlapped first-layer load is ignored, as in CacheBlend's "extra delay negligible").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from cachefuse.errors import ConfigError
from cachefuse.loading.figures import ComputeFigures, TierFigures

RATIO_MODES = ("fixed", "controller")


@dataclass(frozen=True)
class RequestShape:
    num_tokens: int
    """Prompt length; every blend-pass row attends over (up to) this many keys."""
    num_layers: int
    num_full_layers: int
    """Layers 0..f-1 computed at every row (the selector's full layers)."""
    num_candidates: int
    """Cached rows of the declared non-system chunks: the ratio's denominator."""
    num_forced: int
    """Rows computed on top at every selective layer (holes, undeclared tokens, question, last)."""
    bytes_to_load: int
    """KV bytes of all loaded chunks, all layers."""


@dataclass(frozen=True)
class Decision:
    fuse: bool
    ratio: float
    tier: str | None
    reason: str
    est_fused_s: float
    est_prefill_s: float
    est_load_s: float
    est_recompute_s: float
    preload_depth: int


def recompute_time(shape: RequestShape, figures: ComputeFigures, ratio: float) -> float:
    """Blend pass: full layers at every row + selective layers at ceil(ratio*candidates)+forced rows."""
    ctx = shape.num_tokens
    rows = math.ceil(ratio * shape.num_candidates - 1e-9) + shape.num_forced
    num_selective = shape.num_layers - shape.num_full_layers
    return (shape.num_full_layers * figures.layer_time(shape.num_tokens, ctx)
            + num_selective * figures.layer_time(rows, ctx))


def load_time(shape: RequestShape, tier: TierFigures) -> float:
    return shape.bytes_to_load / tier.bytes_per_s


def match_ratio(shape: RequestShape, figures: ComputeFigures, tier: TierFigures) -> float:
    """r in [0, 1] with recompute_time(r) = load_time (whole request; continuous rows, then clamped).

    Solves full + S * (fixed + slope * (r*C + forced)) = load for r, slope = per_row + per_row_key*N.
    """
    num_selective = shape.num_layers - shape.num_full_layers
    slope = figures.per_row_s + figures.per_row_key_s * shape.num_tokens
    if shape.num_candidates <= 0 or num_selective <= 0 or slope <= 0:
        return 0.0 if recompute_time(shape, figures, 0.0) >= load_time(shape, tier) else 1.0
    full = shape.num_full_layers * figures.layer_time(shape.num_tokens, shape.num_tokens)
    per_layer = (load_time(shape, tier) - full) / num_selective
    rows = (per_layer - figures.fixed_s) / slope - shape.num_forced
    return min(1.0, max(0.0, rows / shape.num_candidates))


def choose_ratio(shape: RequestShape, figures: ComputeFigures, tier: TierFigures,
                 r_min: float, r_max: float) -> tuple[float, str]:
    """r = min(r_max, max(r_min, r_match)) and why (CacheBlend: r = max(r*, r_match))."""
    r_match = match_ratio(shape, figures, tier)
    if r_match <= r_min:
        return r_min, f"r_min: loading is faster than recomputing r_min (r_match={r_match:.3f}, {tier.name})"
    if r_match > r_max:
        return r_max, f"capped at r_max (r_match={r_match:.3f}, {tier.name})"
    return r_match, f"load-bound: r raised to hide loading (r_match={r_match:.3f}, {tier.name})"


def preload_depth(num_layers: int, t_prefill_layer: float, t_load_layer: float) -> int:
    """Cache-Craft Eq. 16: layers to load ahead, ceil((L-1)(1 - T_prefill/T_load) + 1), in [1, L].

    `t_prefill_layer` is the blend pass's average compute per layer (recompute_time / L) and
    `t_load_layer` one layer's load (load_time / L); only their ratio matters. Loading no slower
    than compute needs one layer ahead.

    Raises:
        ValueError: num_layers < 1 or a negative time.
    """
    if num_layers < 1 or t_prefill_layer < 0 or t_load_layer < 0:
        raise ValueError(f"preload_depth({num_layers!r}, {t_prefill_layer!r}, {t_load_layer!r}): "
                         "expected num_layers >= 1 and times >= 0")
    if t_load_layer <= t_prefill_layer or t_load_layer <= 0:
        return 1
    depth = (num_layers - 1) * (1.0 - t_prefill_layer / t_load_layer) + 1.0
    return min(num_layers, max(1, math.ceil(depth - 1e-9)))  # 1e-9: 2.0000000001 from rounding is 2


def pipeline_finish(layer_compute_s: Sequence[float], layer_load_s: float, depth: int) -> float:
    """When a pipelined pass ends: one loader thread reads layer after layer (`layer_load_s` each),
    at most `depth` layers ahead of the compute, which needs layer i loaded before it starts."""
    loaded_at: list[float] = []
    compute_start: list[float] = []
    compute_end = 0.0
    for i, compute in enumerate(layer_compute_s):
        # The loader may start layer i once layer i - depth has been consumed (its compute began).
        free_at = 0.0 if i < depth else compute_start[i - depth]
        start = max(loaded_at[-1] if loaded_at else 0.0, free_at)
        loaded_at.append(start + layer_load_s)
        compute_start.append(max(compute_end, loaded_at[i]))
        compute_end = compute_start[i] + compute
    return compute_end


def pipeline_depth(layer_compute_s: Sequence[float], layer_load_s: float, slack: float = 0.02) -> int:
    """The smallest depth whose pipelined pass ends within `slack` of the deepest one's.

    Eq. 16 (preload_depth) assumes every layer computes alike; CacheBlend's full layers are several
    times heavier than the selective ones, and while they run a depth-1 loader sits idle. Simulating
    the pipeline over the per-layer estimates sizes the buffer for the real profile.
    """
    num_layers = len(layer_compute_s)
    if num_layers == 0:
        return 1
    best = pipeline_finish(layer_compute_s, layer_load_s, num_layers)
    for depth in range(1, num_layers + 1):
        if pipeline_finish(layer_compute_s, layer_load_s, depth) <= best * (1.0 + slack):
            return depth
    return num_layers


def layer_compute_times(shape: RequestShape, figures: ComputeFigures, ratio: float) -> list[float]:
    """Estimated compute of each layer of the blend pass at `ratio` (full layers, then selective)."""
    rows = math.ceil(ratio * shape.num_candidates - 1e-9) + shape.num_forced
    full = figures.layer_time(shape.num_tokens, shape.num_tokens)
    selective = figures.layer_time(min(rows, shape.num_tokens), shape.num_tokens)
    num_full = min(shape.num_full_layers, shape.num_layers)
    return [full] * num_full + [selective] * (shape.num_layers - num_full)


def choose_tier(shape: RequestShape, figures: ComputeFigures, tiers: Sequence[TierFigures],
                ratio: float) -> TierFigures:
    """CacheBlend E11: the cheapest tier whose load time <= recompute time at `ratio` (adds no delay).

    Ties in cost go to the faster tier. If no tier hides its loading, the fastest tier (least delay).
    """
    if not tiers:
        raise ValueError("choose_tier needs at least one tier")
    budget = recompute_time(shape, figures, ratio)
    hiding = [t for t in tiers if load_time(shape, t) <= budget]
    if hiding:
        return min(hiding, key=lambda t: (t.cost_rank, -t.bytes_per_s))
    return max(tiers, key=lambda t: t.bytes_per_s)


def decide(shape: RequestShape, figures: ComputeFigures, tiers: Sequence[TierFigures], *,
           r_min: float, r_max: float, ratio_mode: str, fixed_ratio: float, force_fuse: bool,
           margin: float = 0.1) -> Decision:
    """Ratio, tier, preload depth and go/no-go for one request.

    `tiers` are where the request's bytes may be read from (one tier: where they are). "fixed" uses
    `fixed_ratio` and the cheapest tier hiding loading at it; "controller" picks the cheapest tier
    hiding loading at r_min, then raises r against that tier (choose_ratio). Fuse only if the
    estimated fused TTFT max(load, recompute) is below vLLM's own prefill of the prompt by `margin`
    (the estimates are fits: a thin predicted win is not a win), and fewer than every row is
    recomputed (at r = 1 the pass is a full prefill plus loading), unless `force_fuse`. The preload
    depth comes from simulating the pipeline over the per-layer estimates (pipeline_depth).
    """
    if ratio_mode not in RATIO_MODES:
        raise ConfigError(f"ratio_mode={ratio_mode!r} is invalid: expected one of {RATIO_MODES}")
    if not 0.0 <= r_min <= r_max <= 1.0:
        raise ConfigError(f"r_min={r_min!r}, r_max={r_max!r} are invalid: expected 0 <= r_min <= r_max <= 1")
    if ratio_mode == "fixed":
        ratio = fixed_ratio
        tier = choose_tier(shape, figures, tiers, ratio)
        why = f"fixed ratio {ratio:.3f}"
    else:
        tier = choose_tier(shape, figures, tiers, r_min)
        ratio, why = choose_ratio(shape, figures, tier, r_min, r_max)
    est_load = load_time(shape, tier)
    est_recompute = recompute_time(shape, figures, ratio)
    est_fused = max(est_load, est_recompute)
    est_prefill = figures.prefill_time(shape.num_tokens)
    layers = max(1, shape.num_layers)
    depth = pipeline_depth(layer_compute_times(shape, figures, ratio), est_load / layers)
    cmp = f"estimated fused {est_fused * 1e3:.1f} ms"
    vllm = f"vLLM prefill {est_prefill * 1e3:.1f} ms"
    if est_fused < (1.0 - margin) * est_prefill and ratio < 1.0:
        fuse, verdict = True, f"go: {cmp} < {vllm} less {margin:.0%}"
    else:
        bound = f"slow tier {tier.name}" if est_load >= est_recompute else f"recompute-bound at r={ratio:.3f}"
        if ratio >= 1.0:
            bound = f"every row recomputed (r={ratio:.2f}): a full prefill plus loading; {bound}"
        fuse = force_fuse
        verdict = f"{'force_fuse' if force_fuse else 'no-go'}: {cmp} >= {vllm} less {margin:.0%} ({bound})"
    return Decision(fuse=fuse, ratio=ratio, tier=tier.name, reason=f"{verdict}; {why}", est_fused_s=est_fused,
                    est_prefill_s=est_prefill, est_load_s=est_load, est_recompute_s=est_recompute,
                    preload_depth=depth)

"""Loading controller: recompute ratio, preload depth and go/no-go per request.

Imports only the standard library, cachefuse.errors and cachefuse.loading.figures (the figures it
decides from); it runs in the scheduler: no torch, no vllm.
Follows CacheBlend section 5 (E8-E10: r = max(r*, r_match)) and Cache-Craft Eq. 16 / Algorithm 2
(preload depth). Everything is deterministic: figures, clocks and measurements are injected; nothing
here reads the wall clock.

Units: seconds, bytes, bytes/s. `ComputeFigures.layer_time` is one layer of the blend pass;
`recompute_time` and `load_time` are whole-request figures (all layers). Loading layer i+1 overlaps
computing layer i, so the fused TTFT is estimated as max(load, recompute) (the ideal pipeline; the
un-overlapped first-layer load is ignored, as in CacheBlend's "extra delay negligible").

What it prices is what the pass will do:

- Loading, chunk by chunk at the tier that holds it (`RequestShape.bytes_by_tier`, resolved by
  `tier_bytes`): one loader thread reads chunk after chunk, so the tiers' times add up. A chunk is
  priced at the fastest measured tier known to hold it; bytes whose tier is unknown, or is a tier
  without a figure, at the slowest measured tier (an optimistic guess would say "go" to a load it
  cannot hide; docs/loading.md, "Which tier a chunk is priced at").
- Rows, as the selector picks them (`Selector.estimate_rows`): rows it plans per chunk whatever r
  (`num_planned_rows`, cachecraft's ceil(CFO x chunk)) plus ceil(r x the candidates it picks by ratio).
- A query-aware selector's question probe (`RequestShape.num_probe_layers`): the forced rows through
  that many layers before the pass. The probe reads whole entries, so such a request loads every chunk
  before it computes: its fused TTFT is load + probe + pass (nothing overlaps), and raising r hides no
  load, so r stays r_min and the preload depth is 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from cachefuse.errors import ConfigError
from cachefuse.loading.figures import ComputeFigures, TierFigures

RATIO_MODES = ("fixed", "controller")
VERDICTS = ("go", "no_go", "force_fuse")
"""A decision's `verdict`: fused by the estimate, turned down, or fused only because `force_fuse` is on."""


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
    bytes_by_tier: Mapping[str, int] = field(default_factory=dict)
    """Where those bytes are read from: tier name -> bytes (`tier_bytes`). Bytes of `bytes_to_load`
    not listed here are in an unknown tier, priced at the slowest measured one."""
    num_planned_rows: int = 0
    """Candidate rows the selector recomputes at every selective layer whatever r (cachecraft: ceil(CFO
    x chunk) per chunk; epic with a fixed k), from `Selector.estimate_rows`."""
    num_ratio_candidates: int | None = None
    """Candidates the selector picks ceil(r x n) of; None: all `num_candidates` (cacheblend, random)."""
    num_probe_layers: int = 0
    """Layers a query-aware selector's question probe runs before the pass (`ProbeSpec.depth`): the
    forced rows through each, over at most `num_tokens` keys. Non-zero: the load precedes all compute."""
    num_prefix_cached: int = 0
    """Leading tokens vLLM's own prefix cache holds: plain vLLM would compute only the rest, while the
    blend pass computes every row as ever (it only skips writing those slots)."""

    def __post_init__(self) -> None:
        listed = sum(self.bytes_by_tier.values())
        if min(self.bytes_by_tier.values(), default=0) < 0 or listed > self.bytes_to_load:
            raise ValueError(f"bytes_by_tier={dict(self.bytes_by_tier)!r}: expected bytes >= 0 summing to at "
                             f"most bytes_to_load={self.bytes_to_load!r}")


@dataclass(frozen=True)
class Decision:
    fuse: bool
    verdict: str
    """One of VERDICTS: why `fuse` is what it is, in one word (the reason says it in full)."""
    ratio: float
    tier: str | None
    """The tier whose reads take longest (the load's bottleneck); None when nothing is loaded."""
    reason: str
    est_fused_s: float
    est_prefill_s: float
    est_load_s: float
    est_recompute_s: float
    preload_depth: int
    est_load_by_tier_s: dict[str, float]
    """Seconds of loading, by the tier each chunk is priced at (they add up to est_load_s)."""
    est_rows: int
    """Candidate rows recomputed at each selective layer (`selected_rows` at `ratio`), forced rows apart."""
    est_probe_s: float = 0.0
    """The question probe's share of `est_recompute_s` (query-aware selectors; 0 otherwise)."""


def ratio_candidates(shape: RequestShape) -> int:
    """The candidates whose rows scale with r (the selector's ratio-driven part)."""
    return shape.num_candidates if shape.num_ratio_candidates is None else shape.num_ratio_candidates


def selected_rows(shape: RequestShape, ratio: float) -> int:
    """Candidate rows recomputed at each selective layer at `ratio`: the selector's planned rows plus
    ceil(ratio x its ratio-driven candidates), at most every candidate."""
    scaled = math.ceil(ratio * ratio_candidates(shape) - 1e-9)  # 1e-9: 0.15 * 100 = 15.000000000000002
    return min(shape.num_candidates, shape.num_planned_rows + scaled)


def recompute_time(shape: RequestShape, figures: ComputeFigures, ratio: float) -> float:
    """Blend pass: full layers at every row + selective layers at selected_rows(ratio) + forced rows."""
    ctx = shape.num_tokens
    rows = selected_rows(shape, ratio) + shape.num_forced
    num_selective = shape.num_layers - shape.num_full_layers
    return (shape.num_full_layers * figures.layer_time(shape.num_tokens, ctx)
            + num_selective * figures.layer_time(rows, ctx))


def probe_time(shape: RequestShape, figures: ComputeFigures) -> float:
    """The question probe: the forced rows through `num_probe_layers` layers (0 without a probe)."""
    return shape.num_probe_layers * figures.layer_time(shape.num_forced, shape.num_tokens)


def tier_bytes(chunks: Iterable[tuple[int, Sequence[str]]], tiers: Sequence[TierFigures]) -> dict[str, int]:
    """`RequestShape.bytes_by_tier` from the chunks a request loads: (bytes, tiers known to hold it).

    Each chunk counts under the fastest measured tier among those known to hold it; a chunk with no
    measured tier among them is left out (unknown: `load_seconds_by_tier` prices it at the slowest).
    """
    speed = {t.name: t.bytes_per_s for t in tiers}
    by_tier: dict[str, int] = {}
    for num_bytes, names in chunks:
        measured = [name for name in names if name in speed]
        if measured:
            name = max(measured, key=lambda n: speed[n])
            by_tier[name] = by_tier.get(name, 0) + num_bytes
    return by_tier


def load_seconds_by_tier(shape: RequestShape, tiers: Sequence[TierFigures]) -> dict[str, float]:
    """Seconds to read the request's bytes, by the tier each part is priced at.

    Bytes listed under a measured tier are read at its bandwidth; the rest (an unknown tier, or one
    without a figure) at the slowest measured tier. Their sum is the load time: one loader thread
    reads chunk after chunk, whichever tier serves each.

    Raises:
        ValueError: no tier figures.
    """
    if not tiers:
        raise ValueError("pricing a load needs at least one measured tier")
    by_name = {t.name: t for t in tiers}
    slowest = min(tiers, key=lambda t: t.bytes_per_s)
    seconds: dict[str, float] = {}
    for name, num_bytes in [*shape.bytes_by_tier.items(),
                            (slowest.name, shape.bytes_to_load - sum(shape.bytes_by_tier.values()))]:
        tier = by_name.get(name, slowest)
        if num_bytes > 0:
            seconds[tier.name] = seconds.get(tier.name, 0.0) + num_bytes / tier.bytes_per_s
    return seconds


def load_time(shape: RequestShape, tiers: Sequence[TierFigures]) -> float:
    """The whole request's load (all chunks, all layers), priced per tier (load_seconds_by_tier)."""
    return sum(load_seconds_by_tier(shape, tiers).values())


def match_ratio(shape: RequestShape, figures: ComputeFigures, load_s: float) -> float:
    """r in [0, 1] with recompute_time(r) = load_s (whole request; continuous rows, then clamped).

    Solves full + S * (fixed + slope * (planned + r*C + forced)) = load for r, slope = per_row +
    per_row_key*N, C the ratio-driven candidates.
    """
    num_selective = shape.num_layers - shape.num_full_layers
    slope = figures.per_row_s + figures.per_row_key_s * shape.num_tokens
    num_scaled = ratio_candidates(shape)
    if num_scaled <= 0 or num_selective <= 0 or slope <= 0:
        return 0.0 if recompute_time(shape, figures, 0.0) >= load_s else 1.0
    full = shape.num_full_layers * figures.layer_time(shape.num_tokens, shape.num_tokens)
    per_layer = (load_s - full) / num_selective
    rows = (per_layer - figures.fixed_s) / slope - shape.num_forced - shape.num_planned_rows
    return min(1.0, max(0.0, rows / num_scaled))


def choose_ratio(shape: RequestShape, figures: ComputeFigures, load_s: float,
                 r_min: float, r_max: float) -> tuple[float, str]:
    """r = min(r_max, max(r_min, r_match)) and why (CacheBlend: r = max(r*, r_match)).

    A selector with no ratio-driven candidates (cachecraft with every chunk's CFO known) recomputes
    the same rows at any r: raising r would hide nothing, so r stays r_min.
    """
    if ratio_candidates(shape) <= 0:
        return r_min, "r_min: no row depends on r (the selector plans its rows per chunk)"
    r_match = match_ratio(shape, figures, load_s)
    if r_match <= r_min:
        return r_min, f"r_min: loading is faster than recomputing r_min (r_match={r_match:.3f})"
    if r_match > r_max:
        return r_max, f"capped at r_max (r_match={r_match:.3f})"
    return r_match, f"load-bound: r raised to hide loading (r_match={r_match:.3f})"


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
    rows = selected_rows(shape, ratio) + shape.num_forced
    full = figures.layer_time(shape.num_tokens, shape.num_tokens)
    selective = figures.layer_time(min(rows, shape.num_tokens), shape.num_tokens)
    num_full = min(shape.num_full_layers, shape.num_layers)
    return [full] * num_full + [selective] * (shape.num_layers - num_full)


def _describe_load(load_by_tier: Mapping[str, float]) -> str:
    """The load by tier as "disk 10.0 ms + memory 2.3 ms", the slowest part first."""
    parts = sorted(load_by_tier.items(), key=lambda item: -item[1])
    return " + ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in parts) or "nothing"


def decide(shape: RequestShape, figures: ComputeFigures, tiers: Sequence[TierFigures], *,
           r_min: float, r_max: float, ratio_mode: str, fixed_ratio: float, force_fuse: bool,
           margin: float = 0.1) -> Decision:
    """Ratio, preload depth and go/no-go for one request.

    `tiers` are the measured tiers; the request's bytes are priced where `shape.bytes_by_tier` puts
    them, the rest at the slowest tier (load_seconds_by_tier). vLLM's prefill is priced past what its
    own prefix cache holds (`num_prefix_cached`). "fixed" uses `fixed_ratio`;
    "controller" raises r from r_min until recomputing hides that load (choose_ratio). Fuse only if
    the estimated fused TTFT max(load, recompute) is below vLLM's own prefill of the prompt by
    `margin` (the estimates are fits: a thin predicted win is not a win), and fewer than every
    candidate row is recomputed (then the pass is a full prefill plus loading), unless `force_fuse`.
    The preload depth comes from simulating the pipeline over the per-layer estimates (pipeline_depth).
    """
    if ratio_mode not in RATIO_MODES:
        raise ConfigError(f"ratio_mode={ratio_mode!r} is invalid: expected one of {RATIO_MODES}")
    if not 0.0 <= r_min <= r_max <= 1.0:
        raise ConfigError(f"r_min={r_min!r}, r_max={r_max!r} are invalid: expected 0 <= r_min <= r_max <= 1")
    load_by_tier = load_seconds_by_tier(shape, tiers)
    est_load = sum(load_by_tier.values())
    tier = max(load_by_tier, key=load_by_tier.__getitem__, default=None)
    probes = shape.num_probe_layers > 0
    if ratio_mode == "fixed":
        ratio, why = fixed_ratio, f"fixed ratio {fixed_ratio:.3f}"
    elif probes:
        ratio, why = r_min, "r_min: the question probe loads every chunk first, so no r hides the load"
    else:
        ratio, why = choose_ratio(shape, figures, est_load, r_min, r_max)
    rows = selected_rows(shape, ratio)
    est_probe = probe_time(shape, figures)
    est_recompute = recompute_time(shape, figures, ratio) + est_probe
    est_fused = est_load + est_recompute if probes else max(est_load, est_recompute)
    est_prefill = figures.prefill_time(shape.num_tokens, shape.num_prefix_cached)
    layers = max(1, shape.num_layers)
    depth = 0 if probes else pipeline_depth(layer_compute_times(shape, figures, ratio), est_load / layers)
    probe_part = f", of which probe {est_probe * 1e3:.1f} ms; loaded first" if probes else ""
    cmp = (f"estimated fused {est_fused * 1e3:.1f} ms (load {_describe_load(load_by_tier)}, "
           f"recompute {est_recompute * 1e3:.1f} ms{probe_part})")
    vllm = f"vLLM prefill {est_prefill * 1e3:.1f} ms"
    if shape.num_prefix_cached:
        vllm += f" (its prefix cache holds {shape.num_prefix_cached} of {shape.num_tokens} tokens)"
    every_row = shape.num_candidates > 0 and rows >= shape.num_candidates
    if est_fused < (1.0 - margin) * est_prefill and not every_row:
        fuse, verdict, summary = True, "go", f"go: {cmp} < {vllm} less {margin:.0%}"
    else:
        bound = f"slow tier {tier}" if est_load >= est_recompute else f"recompute-bound at r={ratio:.3f}"
        if every_row:
            bound = f"every row recomputed ({rows} of {shape.num_candidates}): a full prefill plus loading; {bound}"
        fuse, verdict = force_fuse, "force_fuse" if force_fuse else "no_go"
        summary = f"{'force_fuse' if force_fuse else 'no-go'}: {cmp} >= {vllm} less {margin:.0%} ({bound})"
    return Decision(fuse=fuse, verdict=verdict, ratio=ratio, tier=tier, reason=f"{summary}; {why}",
                    est_fused_s=est_fused, est_prefill_s=est_prefill, est_load_s=est_load, est_recompute_s=est_recompute,
                    preload_depth=depth, est_load_by_tier_s=load_by_tier, est_rows=rows, est_probe_s=est_probe)

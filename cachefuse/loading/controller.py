"""Loading controller: recompute ratio, tier choice, preload depth and go/no-go per request.

Imports only the standard library and cachefuse.errors (it runs in the scheduler: no torch, no vllm).
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
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace

from cachefuse.errors import ConfigError

RATIO_MODES = ("fixed", "controller")


@dataclass(frozen=True)
class TierFigures:
    """One storage tier: measured read bandwidth and a cost rank (lower = cheaper, disk < memory)."""

    name: str
    bytes_per_s: float
    cost_rank: int

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"tier {self.name!r}: bytes_per_s={self.bytes_per_s!r} must be > 0")


@dataclass(frozen=True)
class ComputeFigures:
    """Cost models of one blend-pass layer and of vLLM's own whole-model prefill (seconds)."""

    fixed_s: float = 0.0
    per_row_s: float = 0.0
    per_row_key_s: float = 0.0
    """Attention: each computed row attends over `context` keys."""
    prefill_fixed_s: float = 0.0
    prefill_per_token_s: float = 0.0
    prefill_per_token2_s: float = 0.0

    def layer_time(self, rows: float, context: float) -> float:
        """One blend-pass layer computing `rows` rows over `context` keys."""
        return self.fixed_s + self.per_row_s * rows + self.per_row_key_s * rows * context

    def prefill_time(self, num_tokens: float) -> float:
        """vLLM's own prefill of a `num_tokens` prompt, all layers."""
        n = num_tokens
        return self.prefill_fixed_s + self.prefill_per_token_s * n + self.prefill_per_token2_s * n * n


class EmaEstimator:
    """Exponential moving average; `value` is None until seeded (start-up probe) or updated."""

    def __init__(self, alpha: float, initial: float | None = None) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha={alpha!r} must be in (0, 1]")
        self.alpha, self.value, self.count = alpha, initial, 0

    def update(self, value: float) -> float:
        self.value = value if self.value is None else self.value + self.alpha * (value - self.value)
        self.count += 1
        return self.value


class BandwidthMeter:
    """Per-tier EMA of read bandwidth (bytes/s) from (bytes, seconds) observations.

    Loads under `min_bytes` are ignored: fixed latency dominates them. Page-cache caveat: a disk read
    served from the OS page cache measures memory speed. The meter records what actually happened,
    per tier, so a warm disk tier looks fast; that is the speed the next load will likely see too.
    """

    def __init__(self, alpha: float = 0.2, min_bytes: int = 1 << 20,
                 probes: Mapping[str, float] | None = None) -> None:
        self.alpha, self.min_bytes = alpha, min_bytes
        self._ema = {name: EmaEstimator(alpha, bps) for name, bps in (probes or {}).items()}

    def observe(self, tier: str, num_bytes: int, seconds: float) -> bool:
        """Record one load; returns False (ignored) for tiny loads or non-positive durations."""
        if num_bytes < self.min_bytes or seconds <= 0:
            return False
        self._ema.setdefault(tier, EmaEstimator(self.alpha)).update(num_bytes / seconds)
        return True

    def tiers(self) -> list[str]:
        """Names of the tiers with a figure (probe or observation)."""
        return list(self._ema)

    def bytes_per_s(self, tier: str) -> float | None:
        ema = self._ema.get(tier)
        return None if ema is None else ema.value

    def tier_figures(self, cost_ranks: Mapping[str, int]) -> list[TierFigures]:
        """TierFigures of every ranked tier that has a figure (probe or observation)."""
        return [TierFigures(name, bps, rank) for name, rank in cost_ranks.items()
                if (bps := self.bytes_per_s(name)) is not None and bps > 0]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (near-)singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max((abs(x) for row in a for x in row), default=0.0)
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) <= 1e-12 * max(scale, 1e-300):
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def _nnls(features: list[list[float]], y: list[float]) -> list[float] | None:
    """Non-negative least squares by trying every support (exact for the 3 features used here)."""
    k = len(features[0])
    norms = [max(abs(row[j]) for row in features) or 1.0 for j in range(k)]
    x = [[row[j] / norms[j] for j in range(k)] for row in features]  # columns scaled to max 1
    best, best_err = None, math.inf
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        ata = [[sum(r[i] * r[j] for r in x) for j in cols] for i in cols]
        aty = [sum(r[i] * t for r, t in zip(x, y, strict=True)) for i in cols]
        sol = _solve(ata, aty)
        if sol is None or min(sol) < 0:
            continue
        coef = [0.0] * k
        for j, c in zip(cols, sol, strict=True):
            coef[j] = c
        err = sum((sum(c * v for c, v in zip(coef, r, strict=True)) - t) ** 2 for r, t in zip(x, y, strict=True))
        if err < best_err:
            best, best_err = coef, err
    return None if best is None else [c / n for c, n in zip(best, norms, strict=True)]


def _fit(features: list[list[float]], y: list[float], base: list[float]) -> list[float]:
    """NNLS with enough distinct samples, else one scale factor on `base` (or on the linear term)."""
    if len({tuple(f) for f in features}) >= len(features[0]):
        coef = _nnls(features, y)
        if coef is not None:
            return coef
    shape = base if any(base) else [0.0, 1.0, 0.0]
    pred = [sum(c * v for c, v in zip(shape, f, strict=True)) for f in features]
    denom = sum(p * p for p in pred)
    s = max(0.0, sum(p * t for p, t in zip(pred, y, strict=True)) / denom) if denom > 0 else 0.0
    return [s * c for c in shape]


def fit_compute_figures(samples: Sequence[tuple[float, float, float]],
                        base: ComputeFigures | None = None) -> ComputeFigures:
    """Fit the blend part (fixed_s, per_row_s, per_row_key_s) to (rows, context, seconds) samples.

    Coefficients are non-negative. With fewer than 3 distinct samples, `base`'s blend part is
    scaled proportionally (or, without one, seconds ~ per_row_s * rows). Prefill fields come from `base`.
    """
    base = base or ComputeFigures()
    if not samples:
        return base
    feats = [[1.0, float(r), float(r) * float(c)] for r, c, _ in samples]
    a, b, c = _fit(feats, [float(s[2]) for s in samples], [base.fixed_s, base.per_row_s, base.per_row_key_s])
    return replace(base, fixed_s=a, per_row_s=b, per_row_key_s=c)


def fit_prefill(samples: Sequence[tuple[float, float]], base: ComputeFigures | None = None) -> ComputeFigures:
    """Fit vLLM's prefill model to (num_tokens, seconds) samples; same rules as fit_compute_figures."""
    base = base or ComputeFigures()
    if not samples:
        return base
    feats = [[1.0, float(n), float(n) * float(n)] for n, _ in samples]
    prior = [base.prefill_fixed_s, base.prefill_per_token_s, base.prefill_per_token2_s]
    a, b, c = _fit(feats, [float(s) for _, s in samples], prior)
    return replace(base, prefill_fixed_s=a, prefill_per_token_s=b, prefill_per_token2_s=c)


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
    """
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers!r} must be >= 1")
    if t_load_layer <= t_prefill_layer or t_load_layer <= 0:
        return 1
    depth = (num_layers - 1) * (1.0 - t_prefill_layer / t_load_layer) + 1.0
    return min(num_layers, max(1, math.ceil(depth - 1e-9)))


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


class AccessCounter:
    """Per chunk key, access frequency with exponential decay (half-life in clock units)."""

    def __init__(self, half_life_s: float, clock: Callable[[], float]) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s={half_life_s!r} must be > 0")
        self.half_life_s, self.clock = half_life_s, clock
        self._score: dict[Hashable, tuple[float, float]] = {}  # key -> (score, at time)

    def _decayed(self, key: Hashable, now: float) -> float:
        score, at = self._score.get(key, (0.0, now))
        return score * 0.5 ** (max(0.0, now - at) / self.half_life_s)

    def record(self, key: Hashable) -> float:
        now = self.clock()
        score = self._decayed(key, now) + 1.0
        self._score[key] = (score, now)
        return score

    def frequency(self, key: Hashable) -> float:
        return self._decayed(key, self.clock())

    def forget(self, key: Hashable) -> None:
        self._score.pop(key, None)


def placement_moves(counter: AccessCounter, tiers_of_keys: Mapping[Hashable, str],
                    tiers: Sequence[TierFigures], hot_threshold: float,
                    cold_threshold: float) -> list[tuple[Hashable, str, str]]:
    """Moves (key, from_tier, to_tier): hot keys (frequency >= hot) one tier faster, cold ones
    (frequency <= cold) one tier slower. Pure: the worker applies them. Keys in unknown tiers stay.
    """
    if not cold_threshold < hot_threshold:
        raise ValueError(f"cold_threshold={cold_threshold!r} must be < hot_threshold={hot_threshold!r}")
    order = [t.name for t in sorted(tiers, key=lambda t: -t.bytes_per_s)]  # fastest first
    moves = []
    for key, name in tiers_of_keys.items():
        if name not in order:
            continue
        i, freq = order.index(name), counter.frequency(key)
        if freq >= hot_threshold and i > 0:
            moves.append((key, name, order[i - 1]))
        elif freq <= cold_threshold and i + 1 < len(order):
            moves.append((key, name, order[i + 1]))
    return moves

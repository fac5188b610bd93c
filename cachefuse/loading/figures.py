"""What the loading controller decides from: measured tier bandwidth and compute cost models.

Imports only the standard library (the scheduler reads these figures: no torch, no vllm). Two halves:

- the figures themselves (`TierFigures`, `ComputeFigures`) and the estimators and fits that produce
  them from samples (`EmaEstimator`, `BandwidthMeter`, `fit_compute_figures`, `fit_prefill`: least
  squares with non-negative coefficients, solved by hand over at most three features);
- `FigureRecorder`, which the worker feeds from real work only: every blend pass (bytes and seconds
  of each load by serving tier; seconds and rows of each layer, but the first pass's: warm-up) and
  every step that was nothing but one plain vLLM prefill (tokens, seconds). `snapshot()` is the plain
  dict that travels to the scheduler in the connector's worker metadata, where
  `cachefuse.loading.controller` decides.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class TierFigures:
    """One storage tier and its measured read bandwidth (the controller prices each chunk's load at the
    tier that holds it)."""

    name: str
    bytes_per_s: float

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

    def row_equivalents(self, rows: float, context: float) -> float:
        """One blend-pass layer of `rows` rows over `context` keys, priced in rows of a full layer of a
        `context`-token prompt (its measured time over a full layer's, times `context`): a full layer is
        `context` rows exactly, and a selective layer of few rows weighs what it costs, its fixed work over
        every token (loading, rotating and merging their K/V) included, not its row count alone. Without a
        measured blend (every coefficient 0) it is `rows`: the row count is all there is to go by."""
        full = self.layer_time(context, context)
        if full <= 0.0 or context <= 0:
            return float(rows)
        return context * self.layer_time(rows, context) / full

    def prefill_time(self, num_tokens: float, cached: float = 0) -> float:
        """vLLM's own prefill of a `num_tokens` prompt, all layers, when its prefix cache holds the first
        `cached` tokens: the step's fixed cost, the new tokens' own cost, and their attention over the keys
        before them (the quadratic term's n^2 - c^2, as a prompt's n^2 is its rows over their keys)."""
        n, c = num_tokens, min(cached, num_tokens)
        return (self.prefill_fixed_s + self.prefill_per_token_s * (n - c)
                + self.prefill_per_token2_s * (n * n - c * c))


def blend_cost_model(snapshot: dict[str, Any]) -> ComputeFigures | None:
    """The blend cost model of a `FigureRecorder.snapshot()`, the one the step budget prices passes by (the
    scheduler's estimates and the worker's charges read the same snapshot), or None while no blend layer has
    been timed (its fit would be all zeros: rows are all there is to go by)."""
    if not snapshot.get("samples", {}).get("blend_layers"):
        return None
    return ComputeFigures(**snapshot["compute"])


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


FIGURE_STALE_S = 60.0
"""A tier figure not updated for this long is stale: the next load of the tier reseeds it, and the
scheduler fuses one request despite a load-bound no-go that has lasted this long, so it is read again."""


class BandwidthMeter:
    """Per-tier EMA of read bandwidth (bytes/s) from (bytes, seconds) observations.

    Loads under `min_bytes` are ignored: fixed latency dominates them. Page-cache caveat: a disk read
    served from the OS page cache measures memory speed. The meter records what actually happened,
    per tier, so a warm disk tier looks fast; that is the speed the next load will likely see too.
    A figure older than `stale_after_s` is replaced by the next observation, not averaged with it.
    """

    def __init__(self, alpha: float = 0.2, min_bytes: int = 1 << 20,
                 probes: Mapping[str, float] | None = None, stale_after_s: float = FIGURE_STALE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.alpha, self.min_bytes, self.stale_after_s, self.clock = alpha, min_bytes, stale_after_s, clock
        self._ema = {name: EmaEstimator(alpha, bps) for name, bps in (probes or {}).items()}
        self._updated = {name: clock() for name in self._ema}

    def observe(self, tier: str, num_bytes: int, seconds: float) -> bool:
        """Record one load; returns False (ignored) for tiny loads or non-positive durations."""
        if num_bytes < self.min_bytes or seconds <= 0:
            return False
        now = self.clock()
        if now - self._updated.get(tier, now) >= self.stale_after_s:
            self._ema.pop(tier)  # the tier went unread (a no-go kept it so): today's speed, not an average
        self._ema.setdefault(tier, EmaEstimator(self.alpha)).update(num_bytes / seconds)
        self._updated[tier] = now
        return True

    def tiers(self) -> list[str]:
        """Names of the tiers with a figure (probe or observation)."""
        return list(self._ema)

    def bytes_per_s(self, tier: str) -> float | None:
        ema = self._ema.get(tier)
        return None if ema is None else ema.value

    def tier_figures(self, names: Iterable[str]) -> list[TierFigures]:
        """TierFigures of every tier in `names` that has a figure (probe or observation)."""
        return [TierFigures(name, bps) for name in names if (bps := self.bytes_per_s(name)) is not None and bps > 0]


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


MAX_SAMPLES = 256
WARMUP_BLENDS = 1
"""A process's first blend passes whose compute is not sampled (their loads are): the first pays one-time
costs (kernel compilation and autotuning on a GPU, first-touch allocations), and fitted it priced every
later blend too high; the controller's recompute-bound no-go then turned requests down on its word."""


class FigureRecorder:
    def __init__(self, min_load_bytes: int = 1 << 20, alpha: float = 0.2, *, warmup_blends: int = WARMUP_BLENDS,
                 stale_after_s: float = FIGURE_STALE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.bandwidth = BandwidthMeter(alpha=alpha, min_bytes=min_load_bytes, stale_after_s=stale_after_s, clock=clock)
        self.blend_samples: deque[tuple[float, float, float]] = deque(maxlen=MAX_SAMPLES)
        self.prefill_samples: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self.changed = False
        self.clock, self.stale_after_s = clock, stale_after_s
        self._warmup_left = warmup_blends
        self._last_blend_at: float | None = None

    def observe_blend(self, stats: Any, num_tokens: int) -> None:
        """One blend pass: FusionStats' loads by tier and its per-layer (rows, seconds). A pass's compute is
        not sampled while warm-up passes are left (WARMUP_BLENDS); one coming `stale_after_s` or more after
        the last sampled pass replaces the samples (no blend ran meanwhile: the scheduler turned requests
        down on these figures, and a pass it fuses to re-measure them must not be averaged into them)."""
        for tier, seconds in stats.load_seconds_by_tier.items():
            self.bandwidth.observe(tier, stats.load_bytes_by_tier.get(tier, 0), seconds)
        self.changed = True
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return
        now = self.clock()
        if self._last_blend_at is not None and now - self._last_blend_at >= self.stale_after_s:
            self.blend_samples.clear()
        self._last_blend_at = now
        for rows, seconds in zip(stats.layer_rows, stats.layer_seconds, strict=True):
            self.blend_samples.append((float(rows), float(num_tokens), float(seconds)))

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step of vLLM's own (unfused) prefills: its tokens and wall time."""
        if num_tokens > 0 and seconds > 0:
            self.prefill_samples.append((float(num_tokens), float(seconds)))
            self.changed = True

    def compute_figures(self) -> ComputeFigures:
        figures = fit_prefill(list(self.prefill_samples)) if self.prefill_samples else ComputeFigures()
        if self.blend_samples:
            figures = fit_compute_figures(list(self.blend_samples), base=figures)
        return figures

    def snapshot(self) -> dict[str, Any]:
        """Serializable figures: tiers' bytes/s, the compute model and how many samples back it."""
        tiers = {name: self.bandwidth.bytes_per_s(name) for name in self.bandwidth.tiers()}
        return {"tiers": {k: v for k, v in tiers.items() if v is not None},
                "compute": dataclasses.asdict(self.compute_figures()),
                "samples": {"blend_layers": len(self.blend_samples), "prefill_steps": len(self.prefill_samples)}}

"""Paired statistics for quality comparisons on the same prompts (pure Python and numpy).

Every comparison in `cachefuse eval` and `benchmarks/quality.py` is paired: two settings scored on
the same items. Exact match uses McNemar's exact test (a binomial test on the discordant pairs) with a
Wald interval of the paired difference; real-valued scores (F1, ROUGE-L, KL) use a seeded paired
bootstrap of the mean difference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

Z_95 = 1.959963984540054


@dataclass(frozen=True)
class MeanSE:
    mean: float
    se: float
    n: int

    def to_dict(self) -> dict:
        return asdict(self)


def mean_se(values: Sequence[float]) -> MeanSE:
    """Mean and standard error of the mean (sample standard deviation / sqrt(n); 0 for n < 2)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("mean_se of no values")
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else 0.0
    return MeanSE(float(x.mean()), se, int(x.size))


@dataclass(frozen=True)
class PairedDiff:
    """a - b over paired items, with a 95% confidence interval and a two-sided p-value."""

    diff: float
    ci_low: float
    ci_high: float
    p_value: float
    n: int
    test: str
    a_only: int | None = None
    """McNemar: items right under a and wrong under b."""
    b_only: int | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _binomial_two_sided(k: int, n: int) -> float:
    """Exact two-sided p-value of k successes in n fair trials (the smaller tail, doubled, capped at 1)."""
    if n == 0:
        return 1.0
    tail = min(k, n - k)
    log_half = n * math.log(0.5)
    p = sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + log_half)
            for i in range(tail + 1))
    return min(1.0, 2.0 * p)


def mcnemar(a: Sequence[bool], b: Sequence[bool]) -> PairedDiff:
    """McNemar's exact test of paired exact-match outcomes, and the Wald 95% CI of EM(a) - EM(b)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"mcnemar needs two equal, non-empty lists (got {len(a)} and {len(b)})")
    n = len(a)
    a_only = sum(1 for x, y in zip(a, b, strict=True) if x and not y)
    b_only = sum(1 for x, y in zip(a, b, strict=True) if y and not x)
    diff = (a_only - b_only) / n
    # Var of the mean paired difference d_i in {-1, 0, 1}: (E[d^2] - E[d]^2) / n.
    se = math.sqrt(max(0.0, (a_only + b_only) / n - diff * diff) / n)
    return PairedDiff(diff, diff - Z_95 * se, diff + Z_95 * se, _binomial_two_sided(a_only, a_only + b_only), n,
                      "mcnemar_exact", a_only, b_only)


def paired_bootstrap(a: Sequence[float], b: Sequence[float], num_resamples: int = 2000,
                     seed: int = 0) -> PairedDiff:
    """Percentile 95% CI of mean(a - b) over `num_resamples` resamples of the items (seeded); the
    p-value is twice the share of resampled means on the far side of 0, counting the observed mean
    among them ((far + 1) / (resamples + 1), capped at 1), so it is never 0. One item is no evidence of
    anything: p = 1 and an unbounded interval."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_bootstrap needs two equal, non-empty lists (got {len(a)} and {len(b)})")
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if d.size == 1:
        return PairedDiff(float(d[0]), -math.inf, math.inf, 1.0, 1, "paired_bootstrap")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(num_resamples, d.size))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    far = np.sum(means <= 0.0) if d.mean() > 0 else np.sum(means >= 0.0)
    p_value = min(1.0, 2.0 * (far + 1) / (num_resamples + 1))
    return PairedDiff(float(d.mean()), float(low), float(high), float(p_value), int(d.size), "paired_bootstrap")


def paired_diff(a: Sequence[float], b: Sequence[float], seed: int = 0) -> PairedDiff:
    """McNemar when both are 0/1 outcomes (exact match), else the paired bootstrap."""
    if all(x in (0, 1) for x in a) and all(y in (0, 1) for y in b):
        return mcnemar([bool(x) for x in a], [bool(y) for y in b])
    return paired_bootstrap(a, b, seed=seed)


def normalized_score(score: float, full_prefill: Sequence[float], full_reuse: Sequence[float]) -> float | None:
    """(S - S_full_reuse) / (S_full_prefill - S_full_reuse), or None when the gap between the two
    baselines is not above twice its (paired) standard error: too small to normalise by."""
    gap = mean_se([p - r for p, r in zip(full_prefill, full_reuse, strict=True)])
    if gap.mean <= 2.0 * gap.se or gap.mean <= 0.0:
        return None
    return (score - float(np.mean(full_reuse))) / gap.mean


def _resampled_over_gap(top: np.ndarray, bottom: np.ndarray, full_prefill: np.ndarray, full_reuse: np.ndarray,
                        num_resamples: int, seed: int) -> tuple[np.ndarray, int]:
    """(mean top - mean bottom) / (mean S_full - mean S_reuse) over seeded resamples of the items (the four
    arrays resampled together, so the pairing is kept), for the resamples whose gap is positive; and how
    many resamples were left out for a gap <= 0."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, top.size, size=(num_resamples, top.size))
    gap = full_prefill[idx].mean(axis=1) - full_reuse[idx].mean(axis=1)
    defined = gap > 0.0
    values = (top[idx].mean(axis=1)[defined] - bottom[idx].mean(axis=1)[defined]) / gap[defined]
    return values, int(num_resamples - defined.sum())


@dataclass(frozen=True)
class NormalizedCI:
    """A normalized score with a percentile 95% interval from resampling the items (all three settings
    together, so the pairing is kept); `undefined` counts the resamples whose baseline gap was <= 0."""

    value: float | None
    ci_low: float | None
    ci_high: float | None
    n: int
    undefined: int

    def to_dict(self) -> dict:
        return asdict(self)


def normalized_bootstrap(scores: Sequence[float], full_prefill: Sequence[float], full_reuse: Sequence[float],
                         num_resamples: int = 2000, seed: int = 0) -> NormalizedCI:
    """(mean S - mean S_reuse) / (mean S_full - mean S_reuse) (FusionRAG's Eq. 11) and its seeded
    bootstrap interval. The point value is `normalized_score`'s (None when the baseline gap is not above
    twice its standard error); the interval is computed over the resamples whose gap is positive, and is
    None when fewer than half of them are."""
    if not len(scores) == len(full_prefill) == len(full_reuse) or not scores:
        raise ValueError(f"normalized_bootstrap needs three equal, non-empty lists (got {len(scores)}, "
                         f"{len(full_prefill)} and {len(full_reuse)})")
    s, f, r = (np.asarray(x, dtype=np.float64) for x in (scores, full_prefill, full_reuse))
    value = normalized_score(float(s.mean()), full_prefill, full_reuse)
    ratios, undefined = _resampled_over_gap(s, r, f, r, num_resamples, seed)
    if ratios.size < num_resamples / 2:
        return NormalizedCI(value, None, None, int(s.size), undefined)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return NormalizedCI(value, float(low), float(high), int(s.size), undefined)


@dataclass(frozen=True)
class NormalizedDiff:
    """normalized(a) - normalized(b) over paired items, both against the same baselines: (mean a - mean b) /
    (mean S_full - mean S_reuse), with a percentile 95% interval from resampling the items jointly (the four
    lists together) and a two-sided p-value as `paired_bootstrap`'s; `undefined` counts the resamples whose
    baseline gap was <= 0 (left out). `diff` is None when the observed gap is not above twice its standard
    error (`normalized_score`'s rule); the interval is None when fewer than half the resamples have a gap."""

    diff: float | None
    ci_low: float | None
    ci_high: float | None
    p_value: float | None
    n: int
    undefined: int

    def to_dict(self) -> dict:
        return asdict(self)


def paired_normalized_bootstrap(a: Sequence[float], b: Sequence[float], full_prefill: Sequence[float],
                                full_reuse: Sequence[float], num_resamples: int = 2000,
                                seed: int = 0) -> NormalizedDiff:
    """The paired difference of two settings' normalized scores (FusionRAG's Eq. 11) and its interval."""
    if not len(a) == len(b) == len(full_prefill) == len(full_reuse) or not a:
        raise ValueError(f"paired_normalized_bootstrap needs four equal, non-empty lists (got {len(a)}, {len(b)}, "
                         f"{len(full_prefill)} and {len(full_reuse)})")
    x, y, f, r = (np.asarray(v, dtype=np.float64) for v in (a, b, full_prefill, full_reuse))
    scale = normalized_score(1.0 + float(r.mean()), full_prefill, full_reuse)  # 1 / gap, or None
    diff = None if scale is None else float(x.mean() - y.mean()) * scale
    diffs, undefined = _resampled_over_gap(x, y, f, r, num_resamples, seed)
    if diffs.size < num_resamples / 2:
        return NormalizedDiff(diff, None, None, None, int(x.size), undefined)
    low, high = np.percentile(diffs, [2.5, 97.5])
    far = np.sum(diffs <= 0.0) if (diff or 0.0) > 0 else np.sum(diffs >= 0.0)
    p_value = min(1.0, 2.0 * (far + 1) / (diffs.size + 1))
    return NormalizedDiff(diff, float(low), float(high), float(p_value), int(x.size), undefined)

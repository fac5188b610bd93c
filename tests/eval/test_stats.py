"""Paired statistics of `cachefuse eval` (cachefuse/eval/stats.py) against hand-computed values."""

from __future__ import annotations

import math

import pytest

from cachefuse.eval.stats import (
    mcnemar,
    mean_se,
    normalized_bootstrap,
    normalized_score,
    paired_bootstrap,
    paired_diff,
    paired_normalized_bootstrap,
)


def test_mean_se_matches_the_sample_formula():
    result = mean_se([1.0, 0.0, 1.0, 1.0])
    assert result.mean == 0.75
    assert result.se == pytest.approx(math.sqrt(0.25) / 2)  # sample std 0.5, n 4
    assert mean_se([3.0]).se == 0.0
    with pytest.raises(ValueError):
        mean_se([])


def test_mcnemar_counts_discordant_pairs_and_gives_the_exact_p_value():
    a = [True] * 10 + [False] * 2 + [True] * 8
    b = [False] * 10 + [True] * 2 + [True] * 8
    result = mcnemar(a, b)
    assert (result.a_only, result.b_only, result.n) == (10, 2, 20)
    assert result.diff == pytest.approx(0.4)
    # Exact two-sided binomial: 2 * P(X <= 2 | n=12, p=1/2) = 2 * (1 + 12 + 66) / 4096.
    assert result.p_value == pytest.approx(2 * 79 / 4096)
    se = math.sqrt((12 / 20 - 0.16) / 20)
    assert (result.ci_low, result.ci_high) == pytest.approx((0.4 - 1.959964 * se, 0.4 + 1.959964 * se))


def test_mcnemar_of_identical_outcomes_is_no_difference():
    result = mcnemar([True, False, True], [True, False, True])
    assert (result.diff, result.p_value, result.ci_low, result.ci_high) == (0.0, 1.0, 0.0, 0.0)


def test_paired_bootstrap_is_seeded_and_brackets_the_mean_difference():
    a = [0.9, 0.8, 0.7, 0.95, 0.85, 0.75, 0.9, 0.8]
    b = [0.5, 0.6, 0.4, 0.55, 0.65, 0.45, 0.5, 0.6]
    first, second = paired_bootstrap(a, b, seed=3), paired_bootstrap(a, b, seed=3)
    assert first == second
    assert first.diff == pytest.approx(sum(a) / 8 - sum(b) / 8)
    assert first.ci_low < first.diff < first.ci_high and first.ci_low > 0
    assert first.p_value < 0.01
    # Negative control: no difference, so the interval straddles 0 and p is large.
    noise = paired_bootstrap([0.1, 0.5, 0.3, 0.2], [0.2, 0.4, 0.3, 0.2], seed=0)
    assert noise.ci_low <= 0 <= noise.ci_high and noise.p_value > 0.5


def test_paired_diff_uses_mcnemar_for_exact_match_and_the_bootstrap_otherwise():
    assert paired_diff([1.0, 0.0], [0.0, 0.0]).test == "mcnemar_exact"
    assert paired_diff([0.5, 0.0], [0.0, 0.0]).test == "paired_bootstrap"


def test_normalized_score_needs_a_gap_above_twice_its_standard_error():
    full = [1.0] * 18 + [0.0] * 2
    reuse = [0.0] * 10 + [1.0] * 10
    # A gap of 0.4 over 20 paired items: far above twice its standard error.
    score = normalized_score(0.8, full, reuse)
    gap = sum(full) / 20 - sum(reuse) / 20
    assert score == pytest.approx((0.8 - 0.5) / gap)
    # Negative control: equal baselines leave nothing to normalise by.
    assert normalized_score(0.5, reuse, reuse) is None
    # A gap within noise: one item of 20.
    assert normalized_score(0.5, [1.0] + [0.0] * 19, [0.0] * 20) is None


def test_paired_bootstrap_never_reports_p_zero_and_one_item_is_no_evidence():
    """Every difference of one sign put no resampled mean beyond 0, so p was 0, even from one or two
    items; the observed mean counts among the resamples, and one item gives p = 1."""
    one = paired_bootstrap([0.4], [0.9])
    assert one.p_value == 1.0 and one.ci_low == -math.inf and one.ci_high == math.inf and one.diff == -0.5
    two = paired_bootstrap([0.5, 0.6], [0.4, 0.5], num_resamples=999)
    assert two.p_value == pytest.approx(2 / 1000)


def test_normalized_bootstrap_of_exact_fractions_of_the_gap_is_that_fraction_in_every_resample():
    full = [0.9, 0.5, 1.0, 0.7, 0.8, 0.6]
    reuse = [0.3, 0.1, 0.2, 0.5, 0.4, 0.0]
    half = [(f + r) / 2 for f, r in zip(full, reuse, strict=True)]
    result = normalized_bootstrap(half, full, reuse, seed=1)
    assert (result.value, result.ci_low, result.ci_high) == pytest.approx((0.5, 0.5, 0.5))
    assert result.undefined == 0 and result.n == 6
    assert normalized_bootstrap(full, full, reuse).to_dict()["ci_low"] == pytest.approx(1.0)
    assert normalized_bootstrap(reuse, full, reuse).value == pytest.approx(0.0)


def test_normalized_bootstrap_brackets_a_noisy_score_and_is_seeded():
    full = [1.0, 0.8, 0.9, 1.0, 0.7, 0.9, 1.0, 0.8]
    reuse = [0.2, 0.1, 0.3, 0.0, 0.2, 0.1, 0.3, 0.2]
    scores = [0.9, 0.2, 0.6, 0.8, 0.3, 0.7, 0.5, 0.6]
    first = normalized_bootstrap(scores, full, reuse, seed=4)
    assert first == normalized_bootstrap(scores, full, reuse, seed=4)
    assert first.value == pytest.approx((sum(scores) - sum(reuse)) / (sum(full) - sum(reuse)))
    assert first.ci_low < first.value < first.ci_high


def test_normalized_bootstrap_without_a_gap_between_the_baselines_gives_no_score():
    same = [0.4, 0.6, 0.5, 0.5]
    result = normalized_bootstrap([0.9, 0.9, 0.9, 0.9], same, same)
    assert (result.value, result.ci_low, result.ci_high) == (None, None, None)
    assert result.undefined == 2000
    with pytest.raises(ValueError, match="three equal"):
        normalized_bootstrap([0.1], [0.2, 0.3], [0.0, 0.1])


def test_paired_normalized_difference_of_exact_gap_fractions_is_that_difference_in_every_resample():
    """a sits at 0.75 of each item's gap and b at 0.25: every resample's difference is 0.5, so the interval
    is [0.5, 0.5]; swapped, -0.5 (the sign is a - b). Negative control: a noisy pair brackets its observed
    difference instead of collapsing onto it."""
    full = [0.9, 0.5, 1.0, 0.7, 0.8, 0.6]
    reuse = [0.3, 0.1, 0.2, 0.5, 0.4, 0.0]
    a = [r + 0.75 * (f - r) for f, r in zip(full, reuse, strict=True)]
    b = [r + 0.25 * (f - r) for f, r in zip(full, reuse, strict=True)]
    result = paired_normalized_bootstrap(a, b, full, reuse, seed=2)
    assert (result.diff, result.ci_low, result.ci_high) == pytest.approx((0.5, 0.5, 0.5))
    assert result.undefined == 0 and result.n == 6 and result.p_value < 0.01
    assert paired_normalized_bootstrap(b, a, full, reuse, seed=2).diff == pytest.approx(-0.5)
    noisy = paired_normalized_bootstrap([0.9, 0.1, 0.8, 0.2, 0.7, 0.3], b, full, reuse, seed=2)
    assert noisy.ci_low < noisy.diff < noisy.ci_high and noisy.p_value > 0.05


def test_paired_normalized_difference_without_a_baseline_gap_claims_nothing():
    same = [0.4, 0.6, 0.5, 0.5]
    result = paired_normalized_bootstrap([0.9] * 4, [0.1] * 4, same, same)
    assert (result.diff, result.ci_low, result.ci_high, result.p_value) == (None, None, None, None)
    assert result.undefined == 2000
    with pytest.raises(ValueError, match="four equal"):
        paired_normalized_bootstrap([0.1], [0.2], [0.3, 0.4], [0.0])

"""cachefuse.metadata.scores: CCI, beta, gamma, beta', CFO, variant choice and f_r against hand-computed cases."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachefuse.metadata.scores import (
    CCI_MAX,
    Variant,
    adjusted_overlap,
    attention_sums,
    cci,
    cfo,
    choose_variant,
    order_penalty,
    prefix_overlap,
    record_use,
    score_variant,
)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def c3_after_c1_c2() -> Variant:
    """The paper's C(C3 | C1 C2): |C3| = 4 tokens after |C1| = 2 and |C2| = 4.

    Each of C3's 4 query rows sums to 1: 0.5 (to C1) + 1.5 (to C2) + 2.0 (within C3) = 4.
    a = 0.5 / (4 * 2) + 1.5 / (4 * 4) = 0.0625 + 0.09375 = 0.15625
    b = 2.0 / 4**2 = 0.125,  a / b = 1.25,  CCI = 1 / (1 + e^-1.25) = 0.77729986...
    """
    return Variant(prefix=("C1", "C2"), inter={"C1": 0.5, "C2": 1.5}, intra=2.0, num_tokens=4,
                   prefix_num_tokens={"C1": 2, "C2": 4})


def c3_alone() -> Variant:
    """C3 cached with no prefix: a = 0, b = 4.0 / 16 = 0.25, CCI = sigmoid(0) = 0.5."""
    return Variant(prefix=(), inter={}, intra=4.0, num_tokens=4)


CCI_C3 = sigmoid(1.25)


# --------------------------------------------------------------------------- hand-computed cases


def test_attention_sums_and_cci_of_c3():
    a, b = attention_sums({"C1": 0.5, "C2": 1.5}, 2.0, 4, {"C1": 2, "C2": 4})
    assert a == pytest.approx(0.15625) and b == pytest.approx(0.125)
    assert c3_after_c1_c2().cci == pytest.approx(0.7772998611746911)
    assert c3_alone().cci == 0.5


def test_same_prefix_is_direct_reuse():
    # beta = (0.5 + 1.5) / (0.5 + 1.5) = 1, gamma = 0 (same order), beta' = 1, CFO = alpha CCI 0 = 0
    v = c3_after_c1_c2()
    assert prefix_overlap(v.prefix, ("C1", "C2"), v.inter) == 1.0
    assert order_penalty(v.prefix, ("C1", "C2")) == 0.0
    assert score_variant(v, ("C1", "C2"), alpha=3.0) == (0.0, 1.0)


def test_prefix_swap_gets_the_full_penalty():
    # C2-C1-C3 for C(C3 | C1 C2): beta = 2 / 2 = 1; A_old = <C1, C2>, A_new = <C2, C1>: m = 2,
    # T = 1, D = 1, gamma = 1; beta' = 1 * (1 - 1) = 0; CFO = 1 * 0.77729986 * (1 - 0) = 0.77729986
    v = c3_after_c1_c2()
    assert prefix_overlap(v.prefix, ("C2", "C1"), v.inter) == 1.0
    assert order_penalty(v.prefix, ("C2", "C1")) == 1.0
    assert adjusted_overlap(1.0, 1.0) == 0.0
    assert score_variant(v, ("C2", "C1"), alpha=1.0) == (pytest.approx(CCI_C3), 0.0)
    # alpha = 2: 2 * 0.77729986 = 1.5546 clamps to 1 (recompute every token)
    assert score_variant(v, ("C2", "C1"), alpha=2.0)[0] == 1.0


def test_disjoint_prefix():
    # C5-C6-C3: nothing common, beta = 0 / 2 = 0, m = 0 so gamma = 0, beta' = 0, CFO = alpha CCI
    v = c3_after_c1_c2()
    assert prefix_overlap(v.prefix, ("C5", "C6"), v.inter) == 0.0
    assert order_penalty(v.prefix, ("C5", "C6")) == 0.0
    assert score_variant(v, ("C5", "C6"), alpha=1.0)[0] == pytest.approx(0.7772998611746911)


def test_partial_overlap_is_weighted_by_inter_attention():
    # The paper's C4-C2-C3: common {C2}, beta = 1.5 / (0.5 + 1.5) = 0.75; m = 1 < 2 so gamma = 0;
    # beta' = 0.75; CFO = 1 * 0.77729986 * 0.25 = 0.19432497
    v = c3_after_c1_c2()
    assert prefix_overlap(v.prefix, ("C4", "C2"), v.inter) == 0.75
    assert order_penalty(v.prefix, ("C4", "C2")) == 0.0
    assert score_variant(v, ("C4", "C2"), alpha=1.0) == (pytest.approx(0.19432496529367277), 0.75)
    # New chunks never lower beta (the paper's beta ignores them): C1-C7-C2 scores 1.
    assert prefix_overlap(v.prefix, ("C1", "C7", "C2"), v.inter) == 1.0


def test_empty_old_prefix():
    # C3 cached alone: CCI = 0.5. Alone again: beta = 1 (choice 6), CFO = 0.
    # After C1: beta = 0, gamma = 0, beta' = 0, CFO = 1 * 0.5 * 1 = 0.5.
    v = c3_alone()
    assert prefix_overlap((), (), {}) == 1.0
    assert prefix_overlap((), ("C1",), {}) == 0.0
    assert score_variant(v, (), alpha=1.0) == (0.0, 1.0)
    assert score_variant(v, ("C1",), alpha=1.0) == (0.5, 0.0)


@pytest.mark.parametrize(("old", "new", "expected"), [
    ((), (), 0.0),
    (("A",), ("A",), 0.0),               # m = 1: no pair
    (("A", "B"), ("B", "X"), 0.0),       # m = 1
    (("A", "B", "C"), ("A", "C", "B"), 1 / 3),   # pairs AB, AC agree; BC discordant: D = 1, T = 3
    # common {A, B, C}: A_old = <A, B, C>, A_new = <C, A, B>; AB agrees, AC and BC are discordant:
    # D = 2, T = 3
    (("A", "X", "B", "C"), ("C", "Y", "A", "B"), 2 / 3),
    (("A", "B", "C", "D"), ("D", "C", "B", "A"), 1.0),  # D = T = 6
    (("A", "B", "A"), ("B", "A"), 1.0),  # A counts at its first occurrence: <A, B> vs <B, A>
])
def test_order_penalty_cases(old, new, expected):
    assert order_penalty(old, new) == pytest.approx(expected)


def test_one_token_chunk():
    # |C| = 1 after |C1| = 3: the one query row is 0.75 to C1 + 0.25 to itself (diagonal, choice 2).
    # a = 0.75 / (1 * 3) = 0.25, b = 0.25 / 1**2 = 0.25, a / b = 1, CCI = sigmoid(1) = 0.73105858
    v = Variant(prefix=("C1",), inter={"C1": 0.75}, intra=0.25, num_tokens=1, prefix_num_tokens={"C1": 3})
    assert attention_sums(v.inter, v.intra, 1, v.prefix_num_tokens) == (0.25, 0.25)
    assert v.cci == pytest.approx(0.7310585786300049)
    # Alone, its row is all self weight: a = 0, b = 1, CCI = 0.5.
    assert Variant(prefix=(), inter={}, intra=1.0, num_tokens=1).cci == 0.5


def test_zero_intra_attention():
    assert cci(0.0, 0.0) == 0.5          # no attention at all: no evidence of outside influence
    assert cci(0.3, 0.0) == CCI_MAX      # all attention outside the chunk: fully contextualised
    assert cci(1e300, 1e-300) == CCI_MAX  # a / b overflows to inf; still below 1
    assert CCI_MAX < 1.0


def test_zero_inter_weights_fall_back_to_counting():
    # Denominator 0 with a non-empty old prefix: beta = |{B}| / |{A, B}| = 0.5 (choice 6)
    assert prefix_overlap(("A", "B"), ("B",), {"A": 0.0, "B": 0.0}) == 0.5


def test_choose_variant_picks_the_lowest_cfo():
    variants = [c3_alone(), c3_after_c1_c2()]
    # C1-C2: alone 0.5 * (1 - 0) = 0.5; after C1 C2: 0  -> index 1
    assert choose_variant(variants, ("C1", "C2"), alpha=1.0) == (1, 0.0)
    # C2-C1: alone 0.5; after C1 C2: 0.777 (swap) -> index 0
    assert choose_variant(variants, ("C2", "C1"), alpha=1.0) == (0, 0.5)
    # C4-C2: alone 0.5; after C1 C2: 0.194 -> index 1
    assert choose_variant(variants, ("C4", "C2"), alpha=1.0) == (1, pytest.approx(0.19432496529367277))


def test_choose_variant_ties():
    variants = [c3_alone(), c3_after_c1_c2()]
    # alpha = 0: every CFO is 0; the higher beta' wins (alone: 0, after C1 C2: 1)
    assert choose_variant(variants, ("C1", "C2"), alpha=0.0) == (1, 0.0)
    # Identical variants: the lower index
    assert choose_variant([c3_after_c1_c2(), c3_after_c1_c2()], ("C9",), alpha=1.0)[0] == 0
    with pytest.raises(ValueError, match="no variants"):
        choose_variant([], ("C1",), alpha=1.0)


def test_record_use_updates_f_r():
    v = c3_alone()
    record_use(v, 0.5)     # f_r = 0 + 1 / 0.5 = 2
    assert (v.access_count, v.f_r) == (1, 2.0)
    record_use(v, 0.0)     # CFO = 0: f_r += 1 / 1e-6 = 1e6
    assert v.access_count == 2 and v.f_r == pytest.approx(2.0 + 1e6)
    record_use(v, 0.0, eps=0.5)  # f_r += 1 / 0.5 = 2
    assert v.f_r == pytest.approx(4.0 + 1e6)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="prefix"):
        Variant(prefix=("C1",), inter={"C2": 1.0}, intra=1.0, num_tokens=2, prefix_num_tokens={"C1": 1})
    with pytest.raises(ValueError, match="prefix"):
        Variant(prefix=("C1",), inter={"C1": 1.0}, intra=1.0, num_tokens=2)
    with pytest.raises(ValueError, match="num_tokens"):
        attention_sums({}, 1.0, 0, {})
    with pytest.raises(ValueError, match="inter"):
        attention_sums({"C1": -1.0}, 1.0, 2, {"C1": 1})
    with pytest.raises(ValueError, match="alpha"):
        cfo(-1.0, 0.5, 0.0, 0.0)
    with pytest.raises(ValueError, match="alpha"):
        cfo(math.nan, 0.5, 0.0, 0.0)
    with pytest.raises(ValueError, match="b="):
        cci(1.0, math.inf)
    with pytest.raises(ValueError, match="eps"):
        record_use(c3_alone(), 0.5, eps=0.0)


# --------------------------------------------------------------------------- properties

KEYS = st.sampled_from(["A", "B", "C", "D", "E", "F", "G"])
PREFIX = st.lists(KEYS, max_size=7)
UNIQUE_PREFIX = st.lists(KEYS, max_size=7, unique=True)
WEIGHT = st.floats(0.0, 1e6, allow_nan=False)
UNIT = st.floats(0.0, 1.0)


@st.composite
def variants(draw) -> Variant:
    prefix = draw(UNIQUE_PREFIX)
    return Variant(prefix=tuple(prefix), inter={key: draw(WEIGHT) for key in prefix}, intra=draw(WEIGHT),
                   num_tokens=draw(st.integers(1, 4096)),
                   prefix_num_tokens={key: draw(st.integers(1, 4096)) for key in prefix})


@given(a=st.floats(0.0, 1e308), b=st.floats(0.0, 1e308))
def test_cci_range(a, b):
    assert 0.5 <= cci(a, b) < 1.0


@given(old=PREFIX, new=PREFIX, weights=st.lists(WEIGHT, min_size=7, max_size=7), order=st.randoms())
def test_beta_range_and_order_invariance(old, new, weights, order):
    inter = dict(zip("ABCDEFG", weights, strict=True))
    beta = prefix_overlap(old, new, inter)
    assert 0.0 <= beta <= 1.0
    shuffled = list(new)
    order.shuffle(shuffled)
    assert prefix_overlap(old, shuffled, inter) == beta
    if old:  # S_old inside S_new (an empty S_old scores 0 against a non-empty S_new, choice 6)
        assert prefix_overlap(old, list(old) + new, inter) == 1.0


@given(old=PREFIX, new=PREFIX)
def test_gamma_range_and_symmetry(old, new):
    gamma = order_penalty(old, new)
    assert 0.0 <= gamma <= 1.0
    assert order_penalty(new, old) == gamma
    assert order_penalty(old, old) == 0.0


@given(old=UNIQUE_PREFIX.filter(lambda p: len(p) >= 2), extra=st.lists(st.sampled_from(["X", "Y"])))
def test_gamma_is_one_for_a_fully_reversed_order(old, extra):
    assert order_penalty(old, extra + old[::-1]) == 1.0
    assert order_penalty(old, old + extra) == 0.0


@given(alpha=st.floats(0.0, 10.0), c1=st.floats(0.5, CCI_MAX), c2=st.floats(0.5, CCI_MAX), beta=UNIT, gamma=UNIT)
def test_cfo_range_and_monotone_in_cci(alpha, c1, c2, beta, gamma):
    low, high = sorted((c1, c2))
    assert 0.0 <= cfo(alpha, low, beta, gamma) <= cfo(alpha, high, beta, gamma) <= 1.0


@given(candidates=st.lists(variants(), min_size=1, max_size=5), new=PREFIX, alpha=st.floats(0.0, 3.0))
def test_choose_variant_returns_the_argmin(candidates, new, alpha):
    index, value = choose_variant(candidates, new, alpha)
    scores = [score_variant(v, new, alpha)[0] for v in candidates]
    assert value == scores[index] == min(scores)


def test_statistics_that_overflow_give_a_cfo_of_one_not_nan():
    """A damaged or foreign row whose inter sums overflow (inf / inf) scores NaN overlap; its CFO is 1 (the
    chunk recomputed), so no NaN reaches the scheduler's planning, where it raised in ceil()."""
    from cachefuse.metadata.base import VariantRecord
    from cachefuse.metadata.index import VariantIndex, plan_variants

    record = VariantRecord(chunk_key="c", prefix=("a", "b"), inter={"a": 1e308, "b": 1e308}, intra=1.0,
                           num_tokens=4, prefix_num_tokens={"a": 4, "b": 4})
    choice = plan_variants(VariantIndex([record]), ["a", "b", "c"], [False] * 3, [4, 4, 4], 1.0)[2]
    assert choice is not None and choice.cfo == 1.0
    from cachefuse.metadata import scores as metadata_scores

    assert metadata_scores.cfo(1.0, 0.7, float("nan"), 0.0) == 1.0
    assert metadata_scores.cfo(1.0, 0.7, 1.0, 0.0) == 0.0  # a number is still clamped, not replaced


def test_a_repeated_chunk_reuses_the_variant_stored_for_exactly_its_prefix():
    """Scores see a repeated chunk once (choice 7), so after [x, x] the variants stored after [x] and
    after [x, x] both score CFO 0: the tie goes to the exact one, not the older one (which was computed
    in another context and would be reused with no row recomputed)."""
    after_x = Variant(prefix=("X",), inter={"X": 1.0}, intra=1.0, num_tokens=4, prefix_num_tokens={"X": 4})
    after_xx = Variant(prefix=("X", "X"), inter={"X": 1.0}, intra=1.0, num_tokens=4, prefix_num_tokens={"X": 4})
    assert choose_variant([after_x, after_xx], ("X", "X"), alpha=1.0) == (1, 0.0)
    assert choose_variant([after_x, after_xx], ("X",), alpha=1.0) == (0, 0.0)

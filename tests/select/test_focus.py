"""Algorithm 1 (focused-chunk detection) on hand-computed cases: the split, its ties and degenerate
inputs, the stability window and the never-stable case."""

import math

import pytest

from cachefuse.select.focus import FocusTracker, focused_set, focused_split

# The research notes' three examples (sorted cinter) with i* under each rule, by hand:
#   [0.5, 0.45, 0.1, 0.05, 0.02]: diff [.05, .35, .05, .03] / .48; largest gap p_2 -> 2;
#       literal -p log p of p_2..p_4 = [.230, .235, .173] -> argmax i = 2.
#   [0.9, 0.1, 0.09, 0.08, 0.07]: diff [.8, .01, .01, .01] / .83; gap p_1 -> 1;
#       literal gains of p_2..p_4 all equal -> the first, i = 1.
#   [0.4, 0.38, 0.36, 0.05, 0.04]: diff [.02, .02, .31, .01] / .36; gap p_3 -> 3;
#       literal gains of p_2..p_4 = [.161, .129, .100] -> i = 1 (the reason "gap" is the default).
NOTES_EXAMPLES = [
    ([0.5, 0.45, 0.1, 0.05, 0.02], 2, 2),
    ([0.9, 0.1, 0.09, 0.08, 0.07], 1, 1),
    ([0.4, 0.38, 0.36, 0.05, 0.04], 3, 1),
]


@pytest.mark.parametrize(("cinter", "gap", "literal"), NOTES_EXAMPLES)
def test_research_note_examples(cinter, gap, literal):
    assert focused_split(cinter) == gap
    assert focused_split(cinter, rule="literal") == literal


def test_literal_rule_is_the_entropy_increment():
    cinter = [0.5, 0.45, 0.1, 0.05, 0.02]
    diff = [cinter[i] - cinter[i + 1] for i in range(len(cinter) - 1)]
    p = [d / sum(diff) for d in diff]
    h = [-sum(x * math.log(x) for x in p[:i]) for i in range(1, len(p) + 1)]  # h_1..h_{k-1}, p_0 absent
    increments = [h[i + 1] - h[i] for i in range(len(h) - 1)]
    assert focused_split(cinter, rule="literal") == 1 + increments.index(max(increments))


def test_unsorted_input_returns_chunk_positions():
    assert focused_set([0.1, 0.5, 0.02, 0.45, 0.05]) == frozenset({1, 3})
    assert focused_set([0.04, 0.36, 0.05, 0.4, 0.38]) == frozenset({1, 3, 4})


def test_ties_in_the_sort_follow_chunk_order():
    # Sorted 5, 4, 4, 0: diff [1, 0, 4] / 5; literal gains of p_2, p_3 = [0, .179] -> i* = 2, inside the tie.
    assert focused_split([5.0, 4.0, 4.0, 0.0], rule="literal") == 2
    assert focused_set([5.0, 4.0, 4.0, 0.0], rule="literal") == frozenset({0, 1})
    assert focused_set([0.0, 4.0, 4.0, 5.0], rule="literal") == frozenset({3, 1})


def test_argmax_ties_take_the_smallest_split():
    assert focused_split([3.0, 2.0, 1.0]) == 1  # equal gaps
    assert focused_set([1.0, 2.0, 1.0, 0.0]) == frozenset({1})  # gaps [1, 0, 1]


@pytest.mark.parametrize("rule", ["gap", "literal"])
def test_degenerate_inputs(rule):
    assert focused_split([], rule) == 0
    assert focused_split([0.7], rule) == 1
    assert focused_split([0.2, 0.2, 0.2], rule) == 3  # all diffs 0: every chunk focused
    assert focused_split([0.0, 0.0, 0.0, 0.0], rule) == 4
    assert focused_split([0.5, 0.5], rule) == 2


def test_two_chunks_gap_splits_literal_keeps_both():
    assert focused_split([0.6, 0.1]) == 1
    assert focused_split([0.1, 0.6]) == 1 and focused_set([0.1, 0.6]) == frozenset({1})
    assert focused_split([0.6, 0.1], rule="literal") == 2  # k < 3: empty argmax range


def test_literal_zero_log_zero():
    # Sorted 1, 1, .5, .5: p = [0, 1, 0]; gains of p_2, p_3 = [1 log 1, 0 log 0] = [0, 0] -> first.
    assert focused_split([1.0, 1.0, 0.5, 0.5], rule="literal") == 1


def test_unknown_rule_and_bad_window():
    with pytest.raises(ValueError, match="rule"):
        focused_split([1.0, 0.0], rule="entropy")
    with pytest.raises(ValueError, match="window"):
        FocusTracker(3, 0)


def test_tracker_window_one_stops_at_the_first_layer():
    tracker = FocusTracker(3, window=1)
    assert tracker.update([0.1, 0.7, 0.2]) == frozenset({1})
    assert tracker.layer == 1 and tracker.focused == frozenset({1})
    assert tracker.update([0.9, 0.0, 0.0]) is None  # reported once (the break)


def test_tracker_waits_for_window_equal_sets():
    tracker = FocusTracker(3, window=3)
    layers = [[1.0, 0.0, 0.0],   # cinter [1, 0, 0] -> {0}
              [0.0, 5.0, 0.0],   # [1, 5, 0] -> {1}
              [0.0, 1.0, 0.0],   # [1, 6, 0] -> {1}
              [0.0, 1.0, 0.0]]   # [1, 7, 0] -> {1}: three equal sets at l = 4
    results = [tracker.update(mass) for mass in layers]
    assert results == [None, None, None, frozenset({1})]
    assert tracker.history == [frozenset({0}), frozenset({1}), frozenset({1}), frozenset({1})]
    assert tracker.cinter == [1.0, 7.0, 0.0] and tracker.layer == 4


def test_tracker_needs_l_at_least_window():
    tracker = FocusTracker(2, window=3)
    assert [tracker.update([0.9, 0.1]) for _ in range(3)] == [None, None, frozenset({0})]
    assert tracker.layer == 3


def test_tracker_never_stable():
    tracker = FocusTracker(2, window=2)
    masses = [[1.0, 0.0]] + [[0.0, 2.0], [2.0, 0.0]] * 3 + [[0.0, 2.0]]
    for mass in masses:  # the leader alternates: cinter [1, 0], [1, 2], [3, 2], [3, 4], ...
        assert tracker.update(mass) is None
    assert tracker.focused is None and tracker.layer is None
    assert len(tracker.history) == 8 and len(set(tracker.history)) == 2


def test_tracker_checks_length():
    with pytest.raises(ValueError, match="expected 3"):
        FocusTracker(3, window=1).update([1.0, 2.0])

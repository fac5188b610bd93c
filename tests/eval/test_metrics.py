"""LongBench's task scores on hand-computed examples."""

import pytest

from cachefuse.eval.metrics import best_score, qa_f1_score, rouge_l_score


def test_rouge_l_hand_examples():
    # LCS of "the cat sat on the mat" and "the cat lay on a mat": the cat on mat (4 tokens)
    p, r = 4 / 6, 4 / 6
    assert rouge_l_score("The cat sat on the mat", "the cat lay on a mat") == pytest.approx(2 * p * r / (p + r))
    assert rouge_l_score("a b c", "a b c") == 1.0
    assert rouge_l_score("a b c", "c b a") == pytest.approx(1 / 3)  # LCS 1: order matters, unlike F1
    assert qa_f1_score("x b c", "c b x") == 1.0  # token F1 ignores order
    assert qa_f1_score("a cat", "the cat") == 1.0  # and articles
    assert rouge_l_score("", "a") == 0.0 and rouge_l_score("a", "") == 0.0 and rouge_l_score("x", "y") == 0.0


def test_best_score_takes_the_max_over_answers():
    assert best_score(qa_f1_score, "Paris France", ["London", "Paris"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="no reference answers"):
        best_score(qa_f1_score, "x", [])

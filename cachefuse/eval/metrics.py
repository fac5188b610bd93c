"""Task scores of generated text against reference answers, as LongBench computes them.

Imports only the standard library.

- `qa_f1_score`: LongBench's (SQuAD's) token F1 after `normalize_answer` (lower case, punctuation and
  the articles a/an/the removed, whitespace collapsed). Used for 2WikiMQA, MuSiQue, HotpotQA.
- `rouge_l_score`: ROUGE-L F1 from the longest common subsequence of lower-cased whitespace tokens
  (SAMSum, MultiNews). LongBench calls the `rouge` package, whose summary-level variant unions LCS
  hits over sentences; for the one-line predictions scored here both agree, and for multi-sentence
  texts this plain LCS is the standard sentence-level ROUGE-L.
- `best_score`: a prediction is scored against each reference answer and the best counts.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """LongBench/SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def qa_f1_score(prediction: str, ground_truth: str) -> float:
    """LongBench's qa_f1_score: F1 of the normalised whitespace tokens (0.0 when none is shared)."""
    pred, truth = normalize_answer(prediction).split(), normalize_answer(ground_truth).split()
    num_same = sum((Counter(pred) & Counter(truth)).values())
    if num_same == 0:
        return 0.0
    precision, recall = num_same / len(pred), num_same / len(truth)
    return 2 * precision * recall / (precision + recall)


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence, O(len(a) * len(b)) time, O(len(b)) memory."""
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0
        for j, y in enumerate(b, start=1):
            diagonal, row[j] = row[j], diagonal + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def rouge_l_score(prediction: str, ground_truth: str) -> float:
    """ROUGE-L F1 over lower-cased whitespace tokens (0.0 when either side is empty)."""
    pred, truth = prediction.lower().split(), ground_truth.lower().split()
    lcs = _lcs_length(pred, truth) if pred and truth else 0
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(truth)
    return 2 * precision * recall / (precision + recall)


def best_score(metric: Callable[[str, str], float], prediction: str, answers: Sequence[str]) -> float:
    """The prediction's best score over the reference answers (LongBench's max over `answers`)."""
    if not answers:
        raise ValueError("best_score: no reference answers")
    return max(metric(prediction, answer) for answer in answers)

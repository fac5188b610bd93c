"""Cache-Craft's focused-chunk detection (Algorithm 1, section 3.2.2) as pure functions.

Imports only the standard library. Per layer l the question's cumulative attention to each chunk
(Eq. 15, cinter^l) is sorted, split into a high "focused" head and a tail, and the split is tracked
until it stays the same for `window` consecutive layers; from then on only the focused chunks keep
recomputing.

```
cinter sorted:   0.50  0.45 | 0.10  0.05  0.02        i* = 2: the top two chunks are focused
diff:               0.05  0.35  0.05  0.03
```

Choices where the paper is ambiguous (research notes, section 1.13):

- Split rule (line 8). The default `rule="gap"` takes i* = argmax_i p_i, the largest normalised
  gap between neighbours in the sorted list: the focused chunks are those above the biggest drop.
  Read literally, line 8 takes argmax_i (h_{i+1} - h_i) = argmax_i -p_{i+1} log p_{i+1}, which
  favours the gap whose share is closest to 1/e (not the largest) and scores split i by the gap
  *after* rank i+1. It splits [0.4, 0.38, 0.36, 0.05, 0.04] after rank 1, where every reading of
  "high-valued chunks" (and the change-point detection the paper cites) puts the change after
  rank 3; the gap rule gets all three examples of the notes right (2, 1, 3). `rule="literal"`
  keeps the paper's formula for comparison (2, 1, 1 on the same examples).
- p_0 (line 7): absent, so h_i = -sum_{j=1..i} p_j log p_j; and 0 log 0 = 0.
- Ties: sorting is stable (equal cinter keep chunk order) and argmax returns the first maximum,
  i.e. the smallest i*.
- Degenerate inputs: no chunks -> i* = 0; one chunk -> 1; all diffs 0 (equal cinter, including
  all zero) -> every chunk is focused (no change point); the literal rule with k < 3 (empty argmax
  range) -> every chunk is focused. The gap rule needs only k >= 2.
- Window (line 11): layers are counted from 1; at layer l >= w the last w focused sets
  (F_all[l-w:l]) must be equal. w = 1 stops at the first layer.
- Never stable: the tracker never reports, and the caller keeps every chunk focused through all
  layers (L* = L).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

RULES = ("gap", "literal")


def _sorted_order(cinter: Sequence[float]) -> list[int]:
    """Chunk positions by descending cinter; equal values keep chunk order."""
    return sorted(range(len(cinter)), key=lambda i: -cinter[i])


def focused_split(cinter: Sequence[float], rule: str = "gap") -> int:
    """How many of the highest-cinter chunks are focused at one layer (Algorithm 1, lines 4-9).

    Args:
        cinter: per chunk, the question's cumulative attention mass up to this layer (Eq. 15), >= 0.
        rule: "gap" (largest normalised gap, the default) or "literal" (line 8 as printed).

    Returns:
        i* in 0..k: the focused chunks are the first i* of the descending sort.
    """
    if rule not in RULES:
        raise ValueError(f"rule={rule!r}, expected one of {RULES}")
    k = len(cinter)
    if k <= 1:
        return k
    values = [float(cinter[i]) for i in _sorted_order(cinter)]
    diff = [values[i] - values[i + 1] for i in range(k - 1)]  # [k-1], >= 0
    total = sum(diff)
    if total <= 0.0:
        return k  # all equal: no change point
    p = [d / total for d in diff]
    if rule == "gap":
        return 1 + max(range(k - 1), key=lambda i: (p[i], -i))  # first maximum
    if k < 3:
        return k
    # h_{i+1} - h_i = -p_{i+1} log p_{i+1} for i in 1..k-2 (1-based); p[i] here is p_{i+1}.
    gain = [-x * math.log(x) if x > 0.0 else 0.0 for x in p[1:]]
    return 1 + max(range(k - 2), key=lambda i: (gain[i], -i))


def focused_set(cinter: Sequence[float], rule: str = "gap") -> frozenset[int]:
    """The chunk positions of the top `focused_split(cinter)` chunks (Algorithm 1, line 9)."""
    return frozenset(_sorted_order(cinter)[:focused_split(cinter, rule)])


class FocusTracker:
    """Algorithm 1 over a layer loop: feed each layer's question-to-chunk mass, get F* once.

    Args:
        num_chunks: k, the number of chunks tracked (positions 0..k-1).
        window: w >= 1, how many consecutive layers the focused set must stay equal.
        rule: the split rule of `focused_split`.

    Attributes:
        cinter: the cumulative mass per chunk (Eq. 15) after the layers fed so far.
        history: the focused set of every layer fed (F_all).
        focused: F* once stable, else None.
        layer: L*, the 1-based layer count at which F* was found, else None.
    """

    def __init__(self, num_chunks: int, window: int, rule: str = "gap") -> None:
        if window < 1:
            raise ValueError(f"window={window!r}, expected an integer >= 1")
        if rule not in RULES:
            raise ValueError(f"rule={rule!r}, expected one of {RULES}")
        self.window, self.rule = window, rule
        self.cinter = [0.0] * num_chunks
        self.history: list[frozenset[int]] = []
        self.focused: frozenset[int] | None = None
        self.layer: int | None = None

    def update(self, layer_mass: Sequence[float]) -> frozenset[int] | None:
        """Adds one layer's mass per chunk (inter^l(C_i, U)); returns F* the first time it is stable.

        Returns None before the set is stable and on every call after it was reported (line 13's break).
        """
        if self.focused is not None:
            return None
        if len(layer_mass) != len(self.cinter):
            raise ValueError(f"layer_mass has {len(layer_mass)} entries, expected {len(self.cinter)}")
        self.cinter = [c + float(m) for c, m in zip(self.cinter, layer_mass, strict=True)]
        self.history.append(focused_set(self.cinter, self.rule))
        seen = len(self.history)  # the paper's l, counted from 1
        if seen >= self.window and len(set(self.history[seen - self.window:seen])) == 1:
            self.focused, self.layer = self.history[-1], seen
            return self.focused
        return None

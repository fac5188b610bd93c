"""cachecraft: Cache-Craft's per-chunk recompute (Eq. 14) with focused-chunk early termination (Algorithm 1).

Imports torch and cachefuse.select.{base, focus}. No full layers: from layer 0 each loaded chunk C
recomputes n = ceil(CFO(C) * |C|) of its tokens, the most contextualised first:

- CFO is `force_cfo` when set (a debug/test override), else the chosen variant's CFO from
  `SelectionContext.reuse`, else the request's recompute ratio: a chunk the metadata does not know
  (no variant record) falls back to the ratio, like every other selector. n is capped at the
  chunk's candidate rows (the prompt's last token is never a candidate).
- The rows are the first n of the variant's `ranked_tokens` (Eq. 14, computed when the variant was
  stored); a variant stored without attention statistics has an empty ranking, and then the chunk's
  first n tokens are taken (EPIC's rule, the attention-sink tokens). A ranking shorter than n is
  continued with the chunk's remaining offsets in order.

With `early_termination`, the fusor passes the question's attention per segment after each layer;
a FocusTracker (Algorithm 1, cachefuse/select/focus.py) accumulates it per candidate chunk, and at
the layer where the focused set has been stable for `window` layers the rows of unfocused chunks are
dropped: in later layers those chunks keep their loaded (re-rotated) K/V (Fig. 16).

```
layers 0..L*:    | system | chunk A: top-n rows | hole B | chunk C: top-n rows | question |
layers L*+1..:   | system | chunk A: top-n rows | hole B | chunk C: loaded K/V | question |
                                (A focused, C not)
```
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cachefuse.select.base import PlannedChunk, RowEstimate, SelectionContext, Selector, num_rows_for_ratio
from cachefuse.select.focus import FocusTracker


class CacheCraftSelector(Selector):
    """Per-request Cache-Craft selection.

    Args:
        force_cfo: every chunk's CFO when not None (variant choice is unaffected).
        window: Algorithm 1's layer confidence window w (>= 1).
        early_termination: stop recomputing unfocused chunks after the focus layer.

    Attributes (figures of the last request, for stats):
        focus_layer: the 0-based layer after which unfocused chunks stop recomputing (the paper's
            1-based L* is focus_layer + 1); None when the focused set never stabilised (or tracking
            is off), in which case every chunk recomputes through all layers.
        focused_segments: segment indices of the focused chunks; every candidate chunk until (and
            unless) the focused set stabilises.
    """

    name = "cachecraft"

    def __init__(self, force_cfo: float | None = None, window: int = 3, early_termination: bool = True) -> None:
        if window < 1:
            raise ValueError(f"window={window!r}, expected an integer >= 1")
        self.force_cfo = force_cfo
        self.window = window
        self.early_termination = early_termination
        self.focus_layer: int | None = None
        self.focused_segments: tuple[int, ...] = ()
        self._chunk_indices: list[int] = []  # segment index of each candidate chunk, in prompt order
        self._selected = torch.zeros(0, dtype=torch.int64)
        self._tracker: FocusTracker | None = None

    def num_full_layers(self, num_layers: int) -> int:
        return 0

    def chunk_cfo(self, ctx: SelectionContext, index: int) -> float:
        """The CFO used for segment `index`: forced, else from its variant's metadata, else the ratio."""
        if self.force_cfo is not None:
            return float(self.force_cfo)
        reuse = ctx.reuse.get(index)
        return float(reuse.cfo) if reuse is not None else float(ctx.ratio)

    def estimate_rows(self, chunks: Sequence[PlannedChunk], num_layers: int) -> RowEstimate:
        """ceil(CFO x tokens) per chunk, as `initial_rows` picks them; a chunk without a CFO follows the
        ratio. An upper bound with `early_termination`: unfocused chunks stop after the focus layer."""
        planned = by_ratio = 0
        for chunk in chunks:
            cfo = self.force_cfo if self.force_cfo is not None else chunk.cfo
            if cfo is None:
                by_ratio += chunk.num_tokens
            else:
                planned += num_rows_for_ratio(float(cfo), chunk.num_tokens)
        return RowEstimate(planned, by_ratio)

    def initial_rows(self, ctx: SelectionContext) -> torch.Tensor:
        index_of = {seg.start: i for i, seg in enumerate(ctx.segments)}
        self._chunk_indices = [index_of[seg.start] for seg in ctx.candidate_segments]
        is_candidate = torch.zeros(ctx.num_tokens, dtype=torch.bool, device=ctx.device)
        is_candidate[ctx.candidate_rows] = True
        is_candidate = is_candidate.tolist()  # one host copy: the per-chunk walk below is Python
        picked: list[int] = []
        for index, seg in zip(self._chunk_indices, ctx.candidate_segments, strict=True):
            reuse = ctx.reuse.get(index)
            ranked = reuse.ranked_tokens if reuse is not None else ()
            picked += self._chunk_rows(seg.start, seg.length, ranked, self.chunk_cfo(ctx, index),
                                       is_candidate[seg.start:seg.end])
        self._selected = torch.tensor(sorted(picked), dtype=torch.int64, device=ctx.device)
        self.focus_layer, self.focused_segments = None, tuple(self._chunk_indices)
        self._tracker = (FocusTracker(len(self._chunk_indices), self.window)
                         if self.early_termination and self._chunk_indices else None)
        return self._selected

    @staticmethod
    def _chunk_rows(start: int, length: int, ranked: tuple[int, ...], cfo: float,
                    is_candidate: list[bool]) -> list[int]:
        """The first ceil(cfo * length) candidate offsets of the ranking (or of the chunk), as rows."""
        order = list(dict.fromkeys(t for t in ranked if 0 <= t < length))  # deduplicated, in rank order
        seen = set(order)
        order += [t for t in range(length) if t not in seen]  # no ranking: the chunk's first tokens
        order = [t for t in order if is_candidate[t]]  # candidate offsets only; is_candidate: [length]
        count = max(0, min(num_rows_for_ratio(cfo, length), len(order)))
        return [t + start for t in order[:count]]

    def tracks_question_attention(self) -> bool:
        return self.early_termination

    def after_layer(self, ctx: SelectionContext, layer: int, question_mass: torch.Tensor) -> torch.Tensor | None:
        if self._tracker is None:
            return None
        chunk_mass = question_mass[self._chunk_indices].tolist()  # [num_chunks]
        focused = self._tracker.update(chunk_mass)
        if focused is None:
            return None
        self._tracker = None  # Algorithm 1 stops at L*
        self.focus_layer = layer
        self.focused_segments = tuple(self._chunk_indices[i] for i in sorted(focused))
        if len(focused) == len(self._chunk_indices):
            return None  # every chunk focused: nothing to drop
        keep = torch.zeros(ctx.num_tokens, dtype=torch.bool, device=ctx.device)
        for index in self.focused_segments:
            seg = ctx.segments[index]
            keep[seg.start:seg.end] = True
        self._selected = self._selected[keep[self._selected]]
        return self._selected

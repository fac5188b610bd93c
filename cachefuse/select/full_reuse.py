"""full_reuse: no full layers, no selected rows; holes, the question and the last token are still
computed, attending over the loaded, re-rotated chunk K/V (the PromptCache-style baseline)."""

from collections.abc import Sequence

import torch

from cachefuse.select.base import PlannedChunk, RowEstimate, SelectionContext, Selector


class FullReuseSelector(Selector):
    name = "full_reuse"

    def num_full_layers(self, num_layers: int) -> int:
        return 0

    def estimate_rows(self, chunks: Sequence[PlannedChunk], num_layers: int) -> RowEstimate:
        return RowEstimate(0, 0)

    def initial_rows(self, ctx: SelectionContext) -> torch.Tensor:
        return ctx.candidate_rows[:0]

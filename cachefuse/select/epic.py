"""epic: recompute the first k tokens of every loaded chunk (EPIC's attention-sink fix), no full layers.

k is the config's `epic_k`, or ceil(ratio * chunk length) per chunk when it is None.
"""

import math
from collections.abc import Sequence

import torch

from cachefuse.select.base import PlannedChunk, RowEstimate, SelectionContext, Selector


class EpicSelector(Selector):
    name = "epic"

    def __init__(self, k: int | None = None) -> None:
        self.k = k

    def num_full_layers(self, num_layers: int) -> int:
        return 0

    def estimate_rows(self, chunks: Sequence[PlannedChunk], num_layers: int) -> RowEstimate:
        """k per chunk when k is set; else ratio-driven (ceil per chunk: up to one row more per chunk)."""
        if self.k is None:
            return RowEstimate(0, sum(chunk.num_tokens for chunk in chunks))
        return RowEstimate(sum(min(self.k, chunk.num_tokens) for chunk in chunks), 0)

    def initial_rows(self, ctx: SelectionContext) -> torch.Tensor:
        picked = []
        for seg in ctx.candidate_segments:
            # A chunk's candidates are its rows but the prompt's last token, which is always computed (a
            # forced row): a chunk that ends the prompt has one less, and EPIC picks among candidates only.
            num_candidates = seg.length - 1 if seg.end == ctx.num_tokens else seg.length
            k = self.k if self.k is not None else math.ceil(ctx.ratio * num_candidates - 1e-9)
            picked.append(torch.arange(seg.start, seg.start + min(k, num_candidates), dtype=torch.int64,
                                       device=ctx.device))
        if not picked:
            return ctx.candidate_rows[:0]
        return torch.cat(picked)

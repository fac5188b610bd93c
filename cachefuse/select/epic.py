"""epic: recompute the first k tokens of every loaded chunk (EPIC's attention-sink fix), no full layers.

k is the config's `epic_k`, or ceil(ratio * chunk length) per chunk when it is None.
"""

import math

import torch

from cachefuse.select.base import SelectionContext, Selector


class EpicSelector(Selector):
    name = "epic"

    def __init__(self, k: int | None = None) -> None:
        self.k = k

    def num_full_layers(self, num_layers: int) -> int:
        return 0

    def initial_rows(self, ctx: SelectionContext) -> torch.Tensor:
        picked = []
        for seg in ctx.candidate_segments:
            k = self.k if self.k is not None else math.ceil(ctx.ratio * seg.length - 1e-9)
            picked.append(torch.arange(seg.start, seg.start + min(k, seg.length), dtype=torch.int64))
        if not picked:
            return ctx.candidate_rows[:0]
        return torch.cat(picked)

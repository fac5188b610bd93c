"""random: a seeded uniform choice of ceil(ratio * candidates) rows, no full layers (a control)."""

import torch

from cachefuse.select.base import SelectionContext, Selector, num_rows_for_ratio


class RandomSelector(Selector):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def num_full_layers(self, num_layers: int) -> int:
        return 0

    def initial_rows(self, ctx: SelectionContext) -> torch.Tensor:
        count = num_rows_for_ratio(ctx.ratio, ctx.candidate_rows.numel())
        generator = torch.Generator().manual_seed(self.seed)
        order = torch.randperm(ctx.candidate_rows.numel(), generator=generator)[:count]
        return ctx.candidate_rows[order].sort().values

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
        # Drawn on the host's generator: the same seed picks the same rows on every device.
        generator = torch.Generator(device="cpu").manual_seed(self.seed)
        order = torch.randperm(ctx.candidate_rows.numel(), generator=generator, device="cpu")[:count]
        order = order.to(ctx.device)
        return ctx.candidate_rows[order].sort().values

"""fixed: recompute exactly the given candidate rows after the given number of full layers.

Not a production selector: the debug hook (`allow_debug_overrides`, request field `selected_rows`)
uses it to inject one selection into two engines and compare them.
"""

from collections.abc import Sequence

import torch

from cachefuse.select.base import SelectionContext, Selector


class FixedSelector(Selector):
    name = "fixed"

    def __init__(self, rows: Sequence[int], num_full_layers: int = 0) -> None:
        self.rows = torch.tensor(sorted(set(rows)), dtype=torch.int64)
        self._num_full_layers = num_full_layers

    def num_full_layers(self, num_layers: int) -> int:
        return min(self._num_full_layers, num_layers)

    def initial_rows(self, ctx: SelectionContext) -> torch.Tensor:
        rows = self.rows.to(ctx.device)
        return rows[torch.isin(rows, ctx.candidate_rows)]

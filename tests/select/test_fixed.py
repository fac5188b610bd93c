"""fixed (cachefuse/select/fixed.py): exactly the given rows that are candidates, after the given full layers."""

import torch

from cachefuse.select.fixed import FixedSelector
from tests.helpers.selection import make_ctx


def test_fixed_recomputes_the_given_candidate_rows_only():
    ctx = make_ctx(0.5)  # the ratio is ignored
    selector = FixedSelector([50, 12, 3, 12, 100, 46], num_full_layers=2)
    assert torch.equal(selector.initial_rows(ctx), torch.tensor([12, 46, 50]))  # sorted, once; not system or question
    assert selector.num_full_layers(8) == 2 and selector.num_full_layers(1) == 1
    assert FixedSelector([]).initial_rows(ctx).numel() == 0 and FixedSelector([10]).num_full_layers(8) == 0

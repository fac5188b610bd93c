"""random (cachefuse/select/random.py): the control is seeded and sized by the ratio."""

import math

import torch

from cachefuse.config import CacheFuseConfig
from cachefuse.select.registry import make_selector
from tests.helpers.selection import make_ctx


def test_random_is_seeded_and_sized():
    ctx = make_ctx(0.3)
    a = make_selector("random", CacheFuseConfig(random_seed=1)).initial_rows(ctx)
    b = make_selector("random", CacheFuseConfig(random_seed=1)).initial_rows(ctx)
    c = make_selector("random", CacheFuseConfig(random_seed=2)).initial_rows(ctx)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.numel() == math.ceil(0.3 * 87)

"""full_reuse (cachefuse/select/full_reuse.py): no full layers and no selected rows."""

from cachefuse.config import CacheFuseConfig
from cachefuse.select.registry import make_selector
from tests.helpers.selection import make_ctx


def test_full_reuse():
    ctx = make_ctx(0.5)
    reuse = make_selector("full_reuse", CacheFuseConfig())
    assert reuse.num_full_layers(8) == 0 and reuse.initial_rows(ctx).numel() == 0

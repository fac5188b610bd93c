"""full_prefill (cachefuse/select/full_prefill.py): every layer is a full layer."""

from cachefuse.config import CacheFuseConfig
from cachefuse.select.registry import make_selector


def test_full_prefill():
    assert make_selector("full_prefill", CacheFuseConfig()).num_full_layers(8) == 8

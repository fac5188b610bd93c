"""full_prefill: every layer computes every row (the exact baseline; the loaded K/V are unused)."""

from cachefuse.select.base import Selector


class FullPrefillSelector(Selector):
    name = "full_prefill"

    def num_full_layers(self, num_layers: int) -> int:
        return num_layers

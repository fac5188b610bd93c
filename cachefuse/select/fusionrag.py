"""fusionrag: FusionRAG's query-guided selection (SIGMOD'26, section 3.2).

The question is run first over every loaded row (a probe through all layers, cachefuse.fusion.probe); its
attention to each context token at the last `score_layers` layers scores the token; one global top-k
at the recompute ratio is recomputed through every layer. Its offline half (chunks stored after their
likely neighbours) is cachefuse.offline.neighbours and works under any selector.

Choices the paper leaves open (docs/selectors.md, "Query-aware selectors"): softmax probabilities
with the full causal denominator rather than raw Q.K products (a raw column sum lets a large-norm key
win without being attended), summed over question rows and heads; the probe conditions the question
on the loaded caches (the paper's Eq. 6); k = ceil(ratio x candidate rows), the system chunk never a
candidate; ties broken by torch.topk.
"""

from cachefuse.select.base import ProbeSelector, ProbeSpec


class FusionRAGSelector(ProbeSelector):
    name = "fusionrag"

    def __init__(self, score_layers: int = 1) -> None:
        assert score_layers >= 1, score_layers
        self.num_score_layers = score_layers

    def probe_spec(self, num_layers: int) -> ProbeSpec:
        first = max(0, num_layers - self.num_score_layers)
        return ProbeSpec(tuple(range(first, num_layers)))

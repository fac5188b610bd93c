"""fusionrag (cachefuse/select/fusionrag.py): the probe scores at the last `score_layers` layers. Its
top-k of the probe's scores is ProbeSelector's: tests/select/test_base.py."""

from cachefuse.config import CacheFuseConfig
from cachefuse.select.registry import make_selector


def test_the_probe_scores_at_the_last_layers():
    assert make_selector("fusionrag", CacheFuseConfig()).probe_spec(8).score_layers == (7,)
    spec = make_selector("fusionrag", CacheFuseConfig(fusionrag_score_layers=3)).probe_spec(8)
    assert spec.score_layers == (5, 6, 7) and spec.depth == 8 and not spec.anchors_only

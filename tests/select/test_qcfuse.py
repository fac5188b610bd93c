"""qcfuse (cachefuse/select/qcfuse.py): the key-norm anchors every save stores (`choose_anchors`, stored
with `with_anchors` by cachefuse/saving.py) are the ones read back. Its top-k of the probe's scores is ProbeSelector's:
tests/select/test_base.py; anchors ranked by received attention: tests/offline/test_anchors.py."""

import pytest
import torch

from cachefuse.select.qcfuse import anchors_from_meta, choose_anchors
from tests.helpers.fusion import make_case, make_engine

pytestmark = pytest.mark.tiny_model("llama", num_layers=3)  # the shared `adapter` (tests/conftest.py)


def test_every_saved_entry_carries_key_norm_anchors_by_default(adapter):
    """Precompute and hole saves store the key-norm anchors (the serving config's ratio and sinks), so
    a qcfuse request reads them instead of every layer's keys."""
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=9)
    config = engine.config
    engine.precompute([case.pieces[0]], prefix_ids=case.system)
    _, stats = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=0.15, save_inline=True)
    assert len(stats.saved_keys) == 3  # the system chunk and B, C as variants after their prefixes
    for key in [engine.key(case.pieces[0]), *stats.saved_keys]:
        entry = engine.store.get(key)
        assert entry is not None
        stored = anchors_from_meta(entry.meta, entry.num_tokens, config.qcfuse_anchor_ratio,
                                   config.qcfuse_sink_tokens)
        expected = choose_anchors(entry, "key_norm", config.qcfuse_anchor_ratio, config.qcfuse_sink_tokens)
        assert stored is not None and torch.equal(stored, expected)

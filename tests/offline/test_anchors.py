"""QCFuse's offline anchors (cachefuse/offline/anchors.py): counts, first tokens, the attention ranking
against transformers' own attention weights, and stored anchors used by the selector. The anchors every
save stores (select/qcfuse.py) are tested in tests/select/test_qcfuse.py."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from cachefuse.chunks import Segment
from cachefuse.config import CacheFuseConfig
from cachefuse.offline.anchors import anchor_annotator, received_attention
from cachefuse.select.qcfuse import anchors_from_meta, choose_anchors
from cachefuse.select.registry import make_selector
from tests.helpers.fusion import make_case, make_engine

pytestmark = pytest.mark.tiny_model("llama", num_layers=3)  # `adapter`, `model_dir`: tests/conftest.py


def _eager_received(model_dir, token_ids, chunk_start):
    """The same quantity from transformers' eager attention weights: the specification."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_attentions=True)
    per_layer = [a[0, :, chunk_start:, :].sum(dim=1).mean(dim=0) for a in out.attentions]  # [T] each
    received = torch.stack(per_layer).mean(dim=0)[chunk_start:]
    viewers = torch.arange(len(token_ids) - chunk_start, 0, -1, dtype=torch.float32)
    return received / viewers


def test_received_attention_equals_transformers_attention_weights(adapter, model_dir):
    case = make_case(adapter.shape.vocab_size, seed=5)
    token_ids = case.system + case.pieces[0]
    start = len(case.system)
    ours = received_attention(adapter, token_ids, start)
    torch.testing.assert_close(ours, _eager_received(model_dir, token_ids, start), atol=1e-5, rtol=1e-4)
    # Negative control: the chunk computed at the prompt's start is another quantity.
    alone = received_attention(adapter, case.pieces[0], 0)
    assert not torch.allclose(alone, ours, atol=1e-3)


@pytest.mark.parametrize("ranking", ["key_norm", "attention"])
def test_stored_anchors_are_counted_kept_first_and_used_by_the_selector(adapter, ranking):
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=6)
    config = CacheFuseConfig()
    ratio, sinks = config.qcfuse_anchor_ratio, config.qcfuse_sink_tokens
    engine.precompute([case.pieces[2]], prefix_ids=case.system,
                      annotate=anchor_annotator(adapter, case.system, ranking, ratio, sinks))
    entry = engine.store.get(engine.key(case.pieces[2]))
    stored = anchors_from_meta(entry.meta, entry.num_tokens, ratio, sinks)
    assert stored is not None and stored.numel() == math.ceil(ratio * entry.num_tokens)
    assert stored[:sinks].tolist() == list(range(sinks)) and stored.unique().numel() == stored.numel()
    selector = make_selector("qcfuse", config)
    segment = Segment(len(case.system), entry.num_tokens, is_chunk=True, is_system=False)
    assert torch.equal(selector.probe_anchors(segment, entry.k_nope, entry.meta), stored)


def test_the_two_rankings_choose_differently(adapter):
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=8, lengths=(12, 80, 10, 10, 5))
    entry = engine.compute_chunk(case.pieces[0], case.system)
    scores = received_attention(adapter, case.system + case.pieces[0], len(case.system))
    by_norm = choose_anchors(entry, "key_norm", 0.1, 1)
    by_attention = choose_anchors(entry, "attention", 0.1, 1, scores)
    assert by_norm.numel() == by_attention.numel() == 8
    assert not torch.equal(by_norm, by_attention)
    with pytest.raises(ValueError, match="ranking"):
        choose_anchors(entry, "attention", 0.1, 1)

"""Fidelity metrics: zero against itself, and greedy continuation on a fused cache equals
transformers' own greedy generation when the cache is the full prefill."""

import torch

from cachefuse.adapters.hf import HFAdapter
from cachefuse.eval import fidelity
from tests.helpers.fusion import make_case, make_engine, precompute_case


def test_metrics_and_continuation(tiny_model_dir):
    adapter = HFAdapter.from_pretrained(str(tiny_model_dir("llama")))
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=11)
    precompute_case(engine, case)
    full, _ = engine.prefill(case.token_ids, case.chunks, selector="full_prefill", save_holes=False)
    reuse, _ = engine.prefill(case.token_ids, case.chunks, selector="full_reuse", save_holes=False)

    assert fidelity.kv_deviation_per_layer(full, full) == [0.0] * adapter.shape.num_layers
    deviation = fidelity.kv_deviation_per_layer(reuse, full)
    assert deviation[0] < 1e-5 < max(deviation)  # layer 0 cannot deviate after re-rotation; later ones do
    assert fidelity.logits_kl(full.logits, full.logits) == 0.0
    assert fidelity.logits_kl(full.logits, reuse.logits) > 0.0

    with torch.inference_mode():
        generated = adapter.model.generate(torch.tensor([case.token_ids]), max_new_tokens=8, do_sample=False,
                                           min_new_tokens=8)
    expected = generated[0, len(case.token_ids):].tolist()
    assert fidelity.greedy_continuation(adapter, full, 8) == expected
    assert fidelity.matching_prefix(expected, expected[:5] + [-1, -1, -1]) == 5

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


def test_teacher_forced_logits_equal_one_forward_over_prompt_and_tokens(tiny_model_dir):
    """Row i is the distribution of continuation token i given the prompt and tokens[:i]: on the full
    prefill's K/V it equals transformers' own forward over prompt + tokens, and its argmax replays the greedy
    continuation. Negative controls: other fed tokens change every row after the first, and a fused cache
    (full reuse) changes row 0."""
    adapter = HFAdapter.from_pretrained(str(tiny_model_dir("llama")))
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=12)
    precompute_case(engine, case)
    full, _ = engine.prefill(case.token_ids, case.chunks, selector="full_prefill", save_holes=False)
    tokens = fidelity.greedy_continuation(adapter, full, 6)

    forced = fidelity.teacher_forced_logits(adapter, full, tokens)
    with torch.inference_mode():
        expected = adapter.model(torch.tensor([case.token_ids + tokens[:-1]])).logits[0, len(case.token_ids) - 1:]
    assert forced.shape == (6, adapter.shape.vocab_size)
    torch.testing.assert_close(forced, expected.float(), atol=1e-4, rtol=1e-4)
    assert forced.argmax(dim=-1).tolist() == tokens

    other = fidelity.teacher_forced_logits(adapter, full, [(t + 1) % adapter.shape.vocab_size for t in tokens])
    assert torch.equal(other[0], forced[0])
    assert all((other[i] - forced[i]).abs().max() > 1e-3 for i in range(1, 6))
    reuse, _ = engine.prefill(case.token_ids, case.chunks, selector="full_reuse", save_holes=False)
    assert (fidelity.teacher_forced_logits(adapter, reuse, tokens)[0] - forced[0]).abs().max() > 1e-3

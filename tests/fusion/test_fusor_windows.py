"""The blend pass on sliding-window models, pinned at both ends as test_fusor.py pins full-attention ones.

The windowed families (cachefuse.testing.tiny_models.WINDOWED_FAMILIES) have a 16-key window, shorter than
the test prompt (94 tokens) and than each stored chunk with its system prompt:

- `mistral_swa`: every layer windowed; `mistral_alt`: windowed and full layers alternating (Ministral);
  `qwen2_swa`: layers 0-1 full, 2-3 windowed (Qwen2's max_window_layers).

Each exactness test has its negative control: the same pass with the windows dropped from the model's
shape (every layer full causal) differs from the model's own forward.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cachefuse.chunks import segment_prompt
from cachefuse.config import CacheFuseConfig
from cachefuse.fusion.fusor import Fusor
from cachefuse.fusion.plan import FuseRequest
from cachefuse.select.registry import make_selector
from cachefuse.testing.tiny_models import TINY_WINDOW, WINDOWED_FAMILIES
from tests.fusion.test_fusor import LOGIT_TOL, model_logits, reference_full_reuse
from tests.helpers.fusion import make_case, make_engine, precompute_case

EXPECTED_WINDOWS = {
    "mistral_swa": (TINY_WINDOW,) * 4,
    "mistral_alt": (TINY_WINDOW, None, TINY_WINDOW, None),
    "qwen2_swa": (None, None, TINY_WINDOW, TINY_WINDOW),
}


def without_windows(adapter):
    """The same adapter object with every layer declared full causal (the negative control's pass)."""
    adapter.shape = dataclasses.replace(adapter.shape, layer_windows=())
    return adapter


@pytest.fixture
def windowed(tiny_adapter):
    """`make(family)`: the family's HFAdapter, its windows restored after the test (adapters are shared)."""
    made = []

    def make(family):
        adapter = tiny_adapter(family)
        made.append((adapter, adapter.shape))
        return adapter

    yield make
    for adapter, shape in made:
        adapter.shape = shape


@pytest.mark.parametrize("family", WINDOWED_FAMILIES)
def test_adapter_reads_each_layers_window(windowed, family):
    adapter = windowed(family)
    assert adapter.shape.layer_windows == EXPECTED_WINDOWS[family]
    assert [adapter.shape.window(i) for i in range(4)] == list(EXPECTED_WINDOWS[family])


@pytest.mark.parametrize("family", WINDOWED_FAMILIES)
def test_full_prefill_selector_equals_model_forward(windowed, family):
    adapter = windowed(family)
    ids = make_case(adapter.shape.vocab_size, seed=3).token_ids
    assert len(ids) > 4 * TINY_WINDOW
    request = FuseRequest(torch.tensor(ids), segment_prompt(len(ids), []), {}, 1.0)
    result = Fusor(adapter).fuse(request, make_selector("full_prefill", CacheFuseConfig()))
    expected = model_logits(adapter, ids)
    torch.testing.assert_close(result.logits, expected, **LOGIT_TOL)
    plain = Fusor(without_windows(adapter)).fuse(request, make_selector("full_prefill", CacheFuseConfig()))
    assert (plain.logits - expected).abs().max() > 100 * LOGIT_TOL["atol"]  # negative control


@pytest.mark.parametrize("family", WINDOWED_FAMILIES)
@pytest.mark.parametrize("selector", ["cacheblend", "epic", "qcfuse"])
def test_ratio_one_equals_full_prefill(windowed, family, selector):
    """Stored chunks (computed with the window after the system prompt), a hole, the question: at ratio 1.0
    every row is recomputed over the merged K/V with the window, as the model's own forward computes it."""
    adapter = windowed(family)
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size)
    precompute_case(engine, case)
    result, stats = engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=1.0, save_holes=False)
    expected = model_logits(adapter, case.token_ids)
    torch.testing.assert_close(result.logits, expected, **LOGIT_TOL)
    assert stats.chunks_hit == 3 and stats.chunks_missed == 1


@pytest.mark.parametrize("family", WINDOWED_FAMILIES)
def test_ratio_one_without_the_window_differs(windowed, family):
    """Negative control of the test above: the same engine and store, the pass's masks without the window."""
    adapter = windowed(family)
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size)
    precompute_case(engine, case)
    expected = model_logits(adapter, case.token_ids)
    without_windows(adapter)
    result, _ = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=1.0, save_holes=False)
    assert (result.logits - expected).abs().max() > 100 * LOGIT_TOL["atol"]


@pytest.mark.parametrize("family", WINDOWED_FAMILIES)
def test_full_reuse_equals_independent_reference(windowed, family):
    adapter = windowed(family)
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=1)
    precompute_case(engine, case)
    result, stats = engine.prefill(case.token_ids, case.chunks, selector="full_reuse", save_holes=False)
    expected = reference_full_reuse(adapter, case)
    torch.testing.assert_close(result.logits, expected, **LOGIT_TOL)
    assert stats.num_selected == 0
    without_windows(adapter)  # negative control: full reuse with unwindowed masks (same stored K/V)
    plain, _ = engine.prefill(case.token_ids, case.chunks, selector="full_reuse", save_holes=False)
    assert (plain.logits - expected).abs().max() > 100 * LOGIT_TOL["atol"]


@pytest.mark.parametrize("family", ["mistral_swa"])
def test_batched_passes_apply_the_window(windowed, family):
    """Two requests batched (one varlen attention call per layer) give what each gives alone, windowed."""
    adapter = windowed(family)
    engine = make_engine(adapter)
    cases = [make_case(adapter.shape.vocab_size, seed=seed) for seed in (0, 4)]
    for case in cases:
        precompute_case(engine, case)
    fusor = engine.fusor
    selector = make_selector("cacheblend", CacheFuseConfig())
    requests = [FuseRequest(torch.tensor(case.token_ids), segment_prompt(len(case.token_ids), case.chunks),
                            {}, 1.0) for case in cases]
    from cachefuse.fusion.batch import PassBatch

    batch = PassBatch(fusor.execute_ops)
    for index, request in enumerate(requests):
        batch.add(index, fusor.fuse_steps(request, selector))
    done = batch.advance()
    assert not done.failed and done.split[0][1] == 2  # batched together
    for index, case in enumerate(cases):
        torch.testing.assert_close(done.finished[index].logits, model_logits(adapter, case.token_ids), **LOGIT_TOL)

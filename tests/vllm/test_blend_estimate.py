"""The step budget's price of a blend pass (`messages.estimated_rows`), before it runs: rows without figures,
the question probe's rows counted, and with measured figures each layer at its cost in rows of a full layer.

Negative controls: a cost model of rows alone (no fixed cost, no attention) prices every layer at its row
count, so only a measured fixed cost raises the selective layers; a probe of depth 0 adds nothing.
"""

from __future__ import annotations

import pytest

from cachefuse.chunks import segment_prompt
from cachefuse.loading.figures import ComputeFigures, blend_cost_model
from cachefuse.metadata.index import VariantChoice
from cachefuse.vllm.messages import estimated_rows

NUM_LAYERS = 4
# 100 tokens: system [0, 10) exact by nature, a [10, 50) and b [50, 90) loaded, the question [90, 100)
SEGMENTS = segment_prompt(100, [(0, 10), (10, 50), (50, 90)])
LOADED = [VariantChoice(name, name, name, 0.0) for name in "sab"]
ROWS_ONLY = ComputeFigures(per_row_s=1e-4)
WITH_FIXED = ComputeFigures(fixed_s=5e-3, per_row_s=1e-4, per_row_key_s=1e-7)


def test_without_figures_the_price_is_the_rows_computed():
    # selective layers: the question's 10 rows + 15% of the 80 candidate rows = 22
    assert estimated_rows(100, SEGMENTS, LOADED, 0.15, NUM_LAYERS, num_full=1) == 100 + 3 * 22
    # a hole: b's 40 rows are computed in every layer
    assert estimated_rows(100, SEGMENTS, [*LOADED[:2], None], 0.15, NUM_LAYERS, num_full=0) == 4 * (50 + 6)


def test_the_probe_adds_the_rows_not_loaded_through_its_layers():
    plain = estimated_rows(100, SEGMENTS, LOADED, 0.15, NUM_LAYERS, num_full=0)
    assert estimated_rows(100, SEGMENTS, LOADED, 0.15, NUM_LAYERS, 0, probe_depth=3) == plain + 3 * 10
    assert estimated_rows(100, SEGMENTS, LOADED, 0.15, NUM_LAYERS, 0, probe_depth=0) == plain  # control


def test_a_full_layer_is_priced_at_its_tokens_whatever_the_figures():
    for figures in (ROWS_ONLY, WITH_FIXED):
        assert figures.row_equivalents(100, 100) == pytest.approx(100)
        assert estimated_rows(100, SEGMENTS, LOADED, 1.0, NUM_LAYERS, NUM_LAYERS, figures=figures) == \
            pytest.approx(NUM_LAYERS * 100)


def test_measured_fixed_costs_price_a_selective_layer_above_its_rows():
    by_rows = estimated_rows(100, SEGMENTS, LOADED, 0.15, NUM_LAYERS, num_full=0)
    # a model of rows alone prices each layer at its rows (the negative control) ...
    assert estimated_rows(100, SEGMENTS, LOADED, 0.15, NUM_LAYERS, 0, figures=ROWS_ONLY) == pytest.approx(by_rows)
    # ... a measured fixed cost per layer raises a 22-row layer to what it costs against a full one
    full = WITH_FIXED.layer_time(100, 100)
    layer = 100 * WITH_FIXED.layer_time(22, 100) / full
    assert layer > 22 * 2
    assert estimated_rows(100, SEGMENTS, LOADED, 0.15, NUM_LAYERS, 0, figures=WITH_FIXED) == \
        pytest.approx(NUM_LAYERS * layer)
    # and the probe's 10-row layers the same way
    probe = 100 * WITH_FIXED.layer_time(10, 100) / full
    assert estimated_rows(100, SEGMENTS, LOADED, 0.15, NUM_LAYERS, 0, probe_depth=2, figures=WITH_FIXED) == \
        pytest.approx(NUM_LAYERS * layer + 2 * probe)


def test_figures_of_nothing_measured_price_rows():
    assert ComputeFigures().row_equivalents(22, 100) == 22


def test_the_budget_prices_by_a_snapshot_only_once_a_blend_layer_is_timed():
    compute = {"fixed_s": 5e-3, "per_row_s": 1e-4, "per_row_key_s": 1e-7, "prefill_fixed_s": 0.0,
               "prefill_per_token_s": 0.0, "prefill_per_token2_s": 0.0}
    assert blend_cost_model({}) is None
    assert blend_cost_model({"compute": compute, "samples": {"blend_layers": 0, "prefill_steps": 3}}) is None
    assert blend_cost_model({"compute": compute, "samples": {"blend_layers": 12}}) == WITH_FIXED

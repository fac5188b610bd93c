"""Every tensor of a fused pass lives on the model's device: a guard that needs no GPU.

The model stays on the CPU while torch's default device is `meta` for the pass (`with
torch.device("meta")`). A tensor created without naming its device, the bug that on a GPU makes the
first layer raise (the worker then runs the request plain, as `blend_error`), lands on `meta`
instead, where the first operation mixing it with the model's tensors raises and no value can be read.
Guarded, the pass must run and give bit-identical results. The negative control plants one such
factory call in a selector and sees the guard catch it.
"""

from __future__ import annotations

import pytest
import torch

from cachefuse.config import CacheFuseConfig
from cachefuse.fusion.fusor import Fusor
from cachefuse.fusion.plan import FuseRequest
from cachefuse.select.epic import EpicSelector
from cachefuse.select.registry import make_selector
from tests.helpers.fusion import hole_request_parts, make_engine, precompute_case

SELECTORS = {
    "cacheblend": {},
    "cacheblend_gradual": {"cacheblend_check_layers": (1, 2), "cacheblend_ratio_schedule": (2.0, 1.0),
                           "cacheblend_sink_tokens": 2, "cacheblend_chunk_floor": 0.5,
                           "cacheblend_deviation": "kv"},
    "epic": {}, "cachecraft": {}, "fusionrag": {}, "qcfuse": {}, "random": {}, "full_reuse": {},
    "full_prefill": {},
}
pytestmark = pytest.mark.tiny_model("llama", num_layers=4)  # the shared `adapter` (tests/conftest.py)


@pytest.fixture(scope="module")
def request_parts(adapter):
    """A RAG prompt with system, two loaded chunks and a hole (B), over a CPU model."""
    return hole_request_parts(adapter, seed=3)


def _fuse(adapter, parts, selector, guarded: bool):
    _, case, segments, loaded = parts
    request = FuseRequest(torch.tensor(case.token_ids), segments, loaded, 0.3, collect_attention_stats=True)
    if not guarded:
        return Fusor(adapter).fuse(request, selector)
    with torch.device("meta"):
        return Fusor(adapter).fuse(request, selector)


def _assert_same(actual, expected):
    assert actual.logits.device.type == "cpu"
    assert torch.equal(actual.logits, expected.logits)
    for k_a, k_e, v_a, v_e in zip(actual.k, expected.k, actual.v, expected.v, strict=True):
        assert torch.equal(k_a, k_e) and torch.equal(v_a, v_e)
    assert actual.hole_token_mass == expected.hole_token_mass
    assert [None if r is None else r.tolist() for r in actual.rows_per_layer] == \
        [None if r is None else r.tolist() for r in expected.rows_per_layer]


@pytest.mark.parametrize("name", list(SELECTORS))
def test_fused_pass_creates_no_tensor_off_the_model_device(adapter, request_parts, name):
    config = CacheFuseConfig(**SELECTORS[name])
    selector_name = "cacheblend" if name.startswith("cacheblend") else name
    expected = _fuse(adapter, request_parts, make_selector(selector_name, config), guarded=False)
    actual = _fuse(adapter, request_parts, make_selector(selector_name, config), guarded=True)
    _assert_same(actual, expected)


def test_engine_prefill_and_hole_save_stay_on_the_model_device(adapter, request_parts):
    engine, case, _, _ = request_parts
    fresh = make_engine(adapter)
    precompute_case(fresh, case)
    with torch.device("meta"):
        result, stats = fresh.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=0.3,
                                      preload_depth=0, save_inline=True)
    expected, _ = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=0.3,
                                 preload_depth=0, save_holes=False)
    assert torch.equal(result.logits, expected.logits)
    assert stats.holes_saved == 1 and stats.chunks_hit == 3


class _HostEpic(EpicSelector):
    """EPIC with the bug the guard exists for: its rows are built without naming a device."""

    def initial_rows(self, ctx):
        rows = [torch.arange(seg.start, seg.start + 2, dtype=torch.int64) for seg in ctx.candidate_segments]
        return torch.cat(rows)


def test_negative_control_a_tensor_made_on_the_default_device_is_caught(adapter, request_parts):
    unguarded = _fuse(adapter, request_parts, _HostEpic(), guarded=False)  # fine on a CPU-only run
    assert unguarded.logits.device.type == "cpu"
    with pytest.raises((RuntimeError, NotImplementedError)):
        _fuse(adapter, request_parts, _HostEpic(), guarded=True)

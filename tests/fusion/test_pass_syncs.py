"""A CacheBlend pass reads nothing back from the device between its first layer and its logits.

On a GPU a read-back (a boolean mask, `nonzero`, `unique`, `.item()`) makes the host wait for every
kernel queued before it. At CacheBlend's check, that drained the two full layers (~9 ms on Llama-3-8B's
shape at 8K tokens) before any selective layer was queued, and the host then issued 30 layers while the
GPU idled. The guard needs no GPU: a TorchDispatchMode records each op that needs a value from the
device, and a marker from `LoadedLayers.advance` says which layer it ran in. Row bookkeeping before the
first layer (the layout's masks) may read back; nothing after may. The negative control plants the
old boolean-mask selection and sees the guard catch it, so it sees what it claims to.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cachefuse.config import CacheFuseConfig
from cachefuse.fusion import fusor as fusor_module
from cachefuse.fusion.fusor import Fusor
from cachefuse.fusion.layers import LoadedLayers
from cachefuse.fusion.plan import FuseRequest
from cachefuse.select.base import CheckLayerKV
from cachefuse.select.registry import make_selector
from tests.helpers.fusion import hole_request_parts

READ_BACK_OPS = {"nonzero", "_unique2", "unique_consecutive", "unique_dim", "_local_scalar_dense", "masked_select",
                 "equal", "is_nonzero", "argwhere"}


class ReadBackRecorder(TorchDispatchMode):
    """Records (layer, op) for every op that needs a device value on the host; `layer` is -1 before the
    first `LoadedLayers.advance`."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = -1
        self.reads: list[tuple[int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))
        if name in READ_BACK_OPS or bool_index:
            self.reads.append((self.layer, name))
        return func(*args, **(kwargs or {}))


pytestmark = pytest.mark.tiny_model("llama", num_layers=4)


@pytest.fixture(scope="module")
def request_parts(adapter):
    _, case, segments, loaded = hole_request_parts(adapter, seed=5)
    return case, segments, loaded


def _reads_in_layers(adapter, request_parts, monkeypatch, ratio: float) -> tuple[list[tuple[int, str]], object]:
    case, segments, loaded = request_parts
    recorder = ReadBackRecorder()
    advance = LoadedLayers.advance

    def marked(self, layer):
        recorder.layer = layer
        return advance(self, layer)

    monkeypatch.setattr(LoadedLayers, "advance", marked)
    request = FuseRequest(torch.tensor(case.token_ids), segments, loaded, ratio)
    with recorder:
        result = Fusor(adapter).fuse(request, make_selector("cacheblend", CacheFuseConfig()))
    return [read for read in recorder.reads if read[0] >= 0], result


@pytest.mark.parametrize("ratio", [0.0, 0.15, 0.5])
def test_cacheblend_pass_reads_nothing_back_after_its_first_layer(adapter, request_parts, monkeypatch, ratio):
    reads, result = _reads_in_layers(adapter, request_parts, monkeypatch, ratio)
    assert reads == []
    assert result.rows_per_layer[2] is not None  # a selective pass, not all rows


def test_negative_control_a_boolean_mask_at_the_check_is_caught(adapter, request_parts, monkeypatch):
    """The selection as it was: the candidates masked out of the computed rows (a read-back)."""
    def masked_select_at_check(self, selector, layout, loaded_kv, layer, check_layers, rows, k_nope, v):
        row_positions = torch.arange(layout.num_tokens) if rows is None else rows
        is_candidate = layout.is_candidate[row_positions]
        candidate_rows = row_positions[is_candidate]
        loaded_k_nope, loaded_v = loaded_kv.stripped(layer)
        kv = CheckLayerKV(rows=candidate_rows, fresh_k_nope=k_nope[is_candidate], fresh_v=v[is_candidate],
                          loaded_k_nope=loaded_k_nope[candidate_rows], loaded_v=loaded_v[candidate_rows])
        return selector.select_at_check(layout.ctx, check_layers.index(layer), kv)
        yield  # a generator of the pass's ops, as Fusor._select_at_check (which yields nothing on one rank)

    monkeypatch.setattr(fusor_module.Fusor, "_select_at_check", masked_select_at_check)
    reads, _ = _reads_in_layers(adapter, request_parts, monkeypatch, 0.15)
    assert reads and {layer for layer, _ in reads} == {1}  # CacheBlend's check layer


def test_the_check_without_read_back_selects_the_same_rows(adapter, request_parts, monkeypatch):
    """The host-side candidates give the masked selection's rows, K/V and logits bit for bit."""
    _, fast = _reads_in_layers(adapter, request_parts, monkeypatch, 0.15)
    monkeypatch.undo()
    test_negative_control_a_boolean_mask_at_the_check_is_caught(adapter, request_parts, monkeypatch)
    _, masked = _reads_in_layers(adapter, request_parts, monkeypatch, 0.15)
    assert [None if r is None else r.tolist() for r in fast.rows_per_layer] == \
        [None if r is None else r.tolist() for r in masked.rows_per_layer]
    assert torch.equal(fast.logits, masked.logits)
    for a, b in zip(fast.k + fast.v, masked.k + masked.v, strict=True):
        assert torch.equal(a, b)

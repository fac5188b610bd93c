"""Pipelined per-layer loading inside the blend pass (docs/loading.md).

- preload_depth 1, 2, 4 give bit-identical logits and K/V to preload_depth 0 (whole entries, serial);
- a slow store changes nothing but time, and no loader thread outlives a pass;
- a layer corrupt mid-pass re-runs the pass with that chunk as a hole, counted as "corrupt".
"""

from __future__ import annotations

import threading

import pytest
import torch

from cachefuse.adapters.hf import HFAdapter
from cachefuse.chunks import KeyContext
from cachefuse.config import CacheFuseConfig
from cachefuse.errors import ConfigError
from cachefuse.fusion.engine import FusionEngine
from cachefuse.store.base import StoreIdentity
from cachefuse.store.disk import DiskStore
from tests.helpers.fusion import make_case, precompute_case
from tests.helpers.throttled import ThrottledStore, real_sleep
from tests.loading.test_loader import _corrupt_tensor

SELECTORS = ["cacheblend", "epic", "full_reuse"]
RATIOS = [0.15, 1.0]


def _disk_store(adapter: HFAdapter, root) -> DiskStore:
    identity = StoreIdentity("test-model", adapter.shape.num_layers, adapter.shape.dtype)
    return DiskStore(root, identity, capacity_bytes=1 << 30)


def _engine(adapter: HFAdapter, store, preload_depth: int | None) -> FusionEngine:
    return FusionEngine(adapter, store, KeyContext("test-model", "float32"),
                        CacheFuseConfig(preload_depth=preload_depth))


@pytest.fixture(scope="module")
def filled(adapter, tmp_path_factory):
    """A disk store holding the system prompt, A and C of a case (B is a hole)."""
    store = _disk_store(adapter, tmp_path_factory.mktemp("pipelined"))
    case = make_case(adapter.shape.vocab_size)
    precompute_case(_engine(adapter, store, 0), case)
    return store, case


def _prefill(engine: FusionEngine, case, selector: str = "cacheblend", ratio: float = 0.15):
    return engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=ratio, save_holes=False)


def _assert_identical(actual, expected) -> None:
    assert torch.equal(actual.logits, expected.logits)
    assert len(actual.k) == len(expected.k)
    for layer, (k, v) in enumerate(zip(actual.k, actual.v, strict=True)):
        assert torch.equal(k, expected.k[layer]), f"K differs at layer {layer}"
        assert torch.equal(v, expected.v[layer]), f"V differs at layer {layer}"
    assert actual.hole_segments == expected.hole_segments


@pytest.mark.parametrize("selector", SELECTORS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_pipelined_pass_is_bit_identical_to_serial(adapter, filled, selector, ratio):
    store, case = filled
    serial, serial_stats = _prefill(_engine(adapter, store, 0), case, selector, ratio)
    num_layers = adapter.shape.num_layers
    # The pipelined fetch skips layers the pass never reads (a full layer that is no check layer:
    # CacheBlend's layer 0); serial loading reads whole entries.
    unread = 1 if selector == "cacheblend" else 0
    for depth in (1, 2, 4, None):
        result, stats = _prefill(_engine(adapter, store, depth), case, selector, ratio)
        _assert_identical(result, serial)
        assert stats.chunks_hit == serial_stats.chunks_hit == 3
        assert stats.chunks_missed == serial_stats.chunks_missed == 1
        assert stats.miss_reasons == serial_stats.miss_reasons == {"not_stored": 1}
        assert stats.bytes_loaded * num_layers == serial_stats.bytes_loaded * (num_layers - unread) > 0
        assert sum(stats.load_bytes_by_tier.values()) == stats.bytes_loaded
        assert stats.tokens_reused == serial_stats.tokens_reused
        assert stats.layer_rows == serial_stats.layer_rows


def test_throttled_store_same_output_and_no_thread_left(adapter, filled):
    store, case = filled
    serial, _ = _prefill(_engine(adapter, store, 0), case)
    throttled = ThrottledStore(store, delay=0.002, sleep=real_sleep)
    baseline = threading.active_count()
    result, stats = _prefill(_engine(adapter, throttled, 2), case)
    _assert_identical(result, serial)
    num_layers = adapter.shape.num_layers
    # system, A, C: every layer the pass reads, once (cacheblend's full layer 0 is never read)
    assert len(throttled.calls) == 3 * (num_layers - 1)
    assert 0 not in {layer for _, layer in throttled.calls}
    assert [layer for _, layer in throttled.calls] == sorted(layer for _, layer in throttled.calls)
    assert threading.active_count() == baseline
    assert not any(t.name == "cachefuse-loader" for t in threading.enumerate())
    assert stats.load_seconds_by_tier and stats.bytes_loaded > 0


@pytest.mark.parametrize("depth", [1, 3])
def test_corrupt_layer_mid_pass_reruns_with_the_chunk_as_a_hole(adapter, filled, tmp_path, depth):
    source, case = filled
    engine = _engine(adapter, _disk_store(adapter, tmp_path / "bad"), depth)
    without_a = _engine(adapter, _disk_store(adapter, tmp_path / "ref"), 0)
    key_a = engine.key(case.pieces[0])
    for key in source.keys():
        assert engine.store.put(key, source.get(key))
        if key != key_a:
            assert without_a.store.put(key, source.get(key))
    _corrupt_tensor(tmp_path / "bad" / key_a[:2] / f"{key_a}.safetensors", "v.2")

    baseline = threading.active_count()
    result, stats = _prefill(engine, case)
    expected, expected_stats = _prefill(without_a, case)
    _assert_identical(result, expected)
    assert stats.miss_reasons == {"corrupt": 1, "not_stored": 1}
    assert expected_stats.miss_reasons == {"not_stored": 2}
    assert (stats.chunks_hit, stats.chunks_missed) == (2, 2)
    assert stats.bytes_loaded == expected_stats.bytes_loaded
    assert threading.active_count() == baseline


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_preload_depth_is_validated(value):
    with pytest.raises(ConfigError, match="preload_depth"):
        CacheFuseConfig(preload_depth=value)
    assert CacheFuseConfig(preload_depth=None).preload_depth is None

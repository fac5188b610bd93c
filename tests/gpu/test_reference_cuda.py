"""The reference engine on a CUDA device: exactness in bf16, selection against CPU fp32, placement, loading.

Runs only with a GPU (`make test-gpu`, marker gpu). The tiny checkpoint is built locally, the same one
the CPU tests use, so the GPU and CPU passes see the same weights.
"""

from __future__ import annotations

import pytest
import torch

from cachefuse.adapters.hf import HFAdapter
from cachefuse.chunks import KeyContext
from cachefuse.config import CacheFuseConfig
from cachefuse.fusion.engine import FusionEngine
from cachefuse.store.base import StoreIdentity
from cachefuse.store.memory import MemoryStore
from tests.helpers.fusion import make_case, precompute_case

pytestmark = [pytest.mark.gpu, pytest.mark.tiny_model("llama", num_layers=4)]  # `model_dir`: tests/conftest.py
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

BF16_LOGIT_TOL = dict(atol=0.1, rtol=0.05)
"""bf16 end to end over 4 layers: logits of order 1-10 agree to a few bf16 ulps of the largest."""


def _engine(model_dir, dtype, device, store_device="cpu", pin=False):
    return _engine_over(HFAdapter.from_pretrained(str(model_dir), dtype=dtype, device=device), store_device, pin)


def _engine_over(adapter, store_device="cpu", pin=False):
    dtype = adapter.shape.dtype
    identity = StoreIdentity("test-model", adapter.shape.num_layers, adapter.shape.dtype)
    store = MemoryStore(identity, capacity_bytes=1 << 30, device=store_device, pin_memory=pin)
    return FusionEngine(adapter, store, KeyContext("test-model", str(dtype).removeprefix("torch.")), CacheFuseConfig())


def _case_engine(model_dir, dtype, device, **store):
    engine = _engine(model_dir, dtype, device, **store)
    case = make_case(engine.adapter.shape.vocab_size, seed=11, lengths=(16, 96, 40, 128, 12))
    precompute_case(engine, case)
    return engine, case


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ratio_one_equals_full_prefill_on_cuda(model_dir, dtype):
    engine, case = _case_engine(model_dir, dtype, "cuda")
    full, _ = engine.prefill(case.token_ids, case.chunks, selector="full_prefill", save_holes=False)
    blend, stats = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=1.0, save_holes=False)
    assert full.logits.is_cuda and stats.chunks_hit == 3
    with torch.no_grad():
        plain = engine.adapter.model(torch.tensor([case.token_ids], device="cuda")).logits[0, -1].float()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else BF16_LOGIT_TOL
    torch.testing.assert_close(full.logits, plain, **tol)
    torch.testing.assert_close(blend.logits, full.logits, **tol)
    assert int(blend.logits.argmax()) == int(full.logits.argmax())


def _selected_rows(engine, case, ratio=0.15):
    result, _ = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=ratio, save_holes=False)
    return set(result.rows_per_layer[-2].tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selection_at_15_percent_matches_cpu_fp32(model_dir, dtype):
    cpu, case = _case_engine(model_dir, torch.float32, "cpu")
    gpu, _ = _case_engine(model_dir, dtype, "cuda")
    expected, actual = _selected_rows(cpu, case), _selected_rows(gpu, case)
    assert len(actual) == len(expected)
    overlap = len(actual & expected) / len(expected)
    # fp32: only near-ties may differ (summation order); bf16 rounds the deviations themselves.
    assert overlap >= (0.97 if dtype == torch.float32 else 0.85), (overlap, sorted(actual ^ expected))


def test_fused_pass_on_cuda_creates_every_tensor_on_the_device(model_dir):
    engine, case = _case_engine(model_dir, torch.bfloat16, "cuda")
    for selector in ("cacheblend", "epic", "cachecraft", "fusionrag", "qcfuse"):
        expected, _ = engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.3,
                                     save_holes=False, preload_depth=0)
        with torch.device("meta"):  # a factory call without a device lands here and fails
            actual, _ = engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.3,
                                       save_holes=False, preload_depth=0)
        assert torch.equal(actual.logits, expected.logits), selector


@pytest.mark.parametrize("tier", ["pinned_host", "device"])
def test_pipelined_loads_from_each_tier_equal_serial_loads(model_dir, tier):
    store = dict(pin=True) if tier == "pinned_host" else dict(store_device="cuda")
    engine, case = _case_engine(model_dir, torch.bfloat16, "cuda", **store)
    serial, _ = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=0.15,
                               save_holes=False, preload_depth=0)
    for depth in (1, 3):
        piped, stats = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=0.15,
                                      save_holes=False, preload_depth=depth)
        assert torch.equal(piped.logits, serial.logits), depth
        assert stats.chunks_hit == 3
    entry = engine.store.get(engine.store.keys()[0])
    assert entry.k_nope[0].is_cuda if tier == "device" else entry.k_nope[0].is_pinned()


def test_layer_times_come_from_cuda_events(model_dir):
    engine, case = _case_engine(model_dir, torch.bfloat16, "cuda")
    _, stats = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=0.15, save_holes=False)
    assert len(stats.layer_seconds) == engine.adapter.shape.num_layers
    assert all(0.0 < s < 10.0 for s in stats.layer_seconds)
    assert stats.blend_time_s >= sum(stats.layer_seconds) * 0.5  # the pass ends synchronised


def test_inductor_compiled_layers_equal_eager_on_cuda(model_dir):
    from transformers import AutoModelForCausalLM

    results = []
    for compile in (False, True):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, attn_implementation="sdpa")
        engine = _engine_over(HFAdapter(model.to("cuda"), compile=compile))
        case = make_case(engine.adapter.shape.vocab_size, seed=11, lengths=(16, 96, 40, 128, 12))
        precompute_case(engine, case)
        results.append(engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=0.15,
                                      save_holes=False)[0])
    torch.testing.assert_close(results[1].logits, results[0].logits, **BF16_LOGIT_TOL)

"""Reading a paged cache in place (cachefuse.vllm.cache_views) and SlotWritingAttention's rows from it.

vLLM's GPU backends store a token's K then V in each row of a per-layer cache of logical shape
[pages, kv_heads, page_size, 2 * head_dim]; FlashAttention's writer (`reshape_and_cache_flash`) is a CUDA
op, so `FlashLayoutImpl` below does what that op does, in torch (vLLM's own Triton backend, whose writer
is a Triton kernel, runs interpreted in tests/vllm/test_triton_backend.py):
`key_cache[slot // page_size, slot % page_size] = key` on `cache.transpose(1, 2).split(head_dim, -1)`.
The views are proven by a probe through the layer's own writer, so a writer that stores anything else
must be refused: an off-by-one writer and a raising one here, vLLM's real CPU backend (which packs keys)
in tests/vllm/test_paged.py.

The whole pass: a tiny model's fused prefill with SlotWritingAttention over such layers reads every
selected row's keys from the pages and gives the same logits as the pass over contiguous K/V (bit for
bit with the torch twins, within the kernel tolerance with the interpreted Triton kernel).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from cachefuse.adapters.hf import HFAdapter
from cachefuse.vllm import cache_views
from cachefuse.vllm.cache_views import paged_kv_views
from cachefuse.vllm.paged import SlotWritingAttention
from tests.helpers.fusion import make_case, make_engine, precompute_case
from tests.helpers.tolerances import TOL


class FlashLayoutImpl:
    """do_kv_cache_update as vLLM's FlashAttention backend does it (reshape_and_cache_flash), in torch."""

    kv_cache_dtype = "auto"

    def __init__(self, head_size: int, slot_shift: int = 0) -> None:
        self.head_size, self.slot_shift, self.writes = head_size, slot_shift, 0

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self.writes += 1
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        page_size = key_cache.shape[1]
        slots = (slot_mapping + self.slot_shift) % (key_cache.shape[0] * page_size)
        key_cache[slots // page_size, slots % page_size] = key
        value_cache[slots // page_size, slots % page_size] = value


class OffByOneImpl(FlashLayoutImpl):
    """Stores each token one slot later than asked: a layout the views would misread."""

    def __init__(self, head_size: int) -> None:
        super().__init__(head_size, slot_shift=1)


class RaisingImpl(FlashLayoutImpl):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        raise RuntimeError("no writer on this device")


def make_layer(impl, num_pages=12, page_size=16, num_kv_heads=2, head_dim=8, head_major=False):
    """A layer whose cache is stored page, token, head (LBNHC) or page, head, token (head_major)."""
    if head_major:
        cache = torch.zeros(num_pages, num_kv_heads, page_size, 2 * head_dim)
    else:
        cache = torch.zeros(num_pages, page_size, num_kv_heads, 2 * head_dim).permute(0, 2, 1, 3)
    return SimpleNamespace(impl=impl, kv_cache=cache)


@pytest.fixture(autouse=True)
def fresh_verdicts():
    cache_views._verdicts.clear()
    yield
    cache_views._verdicts.clear()


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
def test_probe_proves_the_flash_layout_and_views_read_written_tokens(head_major):
    impl = FlashLayoutImpl(head_size=8)
    layer = make_layer(impl, head_major=head_major)
    views = paged_kv_views(layer)
    assert views is not None and views[0].shape == (12, 16, 2, 8)
    assert torch.count_nonzero(layer.kv_cache) == 0  # the probe wrote a scratch cache, not the live one
    k, v = torch.randn(37, 2, 8), torch.randn(37, 2, 8)
    slots = torch.randperm(12 * 16)[:37]
    impl.do_kv_cache_update(layer, k, v, layer.kv_cache, slots)
    assert torch.equal(views[0][slots // 16, slots % 16], k) and torch.equal(views[1][slots // 16, slots % 16], v)


def test_probe_runs_once_per_backend_and_layout():
    impls = [FlashLayoutImpl(head_size=8) for _ in range(3)]
    for impl in impls:
        assert paged_kv_views(make_layer(impl)) is not None
    assert [impl.writes for impl in impls] == [1, 0, 0]
    other_layout = FlashLayoutImpl(head_size=8)
    assert paged_kv_views(make_layer(other_layout, head_major=True)) is not None and other_layout.writes == 1


@pytest.mark.parametrize("impl_type", [OffByOneImpl, RaisingImpl])
def test_negative_control_probe_refuses_a_writer_the_views_misread(impl_type):
    assert paged_kv_views(make_layer(impl_type(head_size=8))) is None


def test_a_cache_of_another_shape_is_not_viewed():
    impl = FlashLayoutImpl(head_size=8)
    layer = SimpleNamespace(impl=impl, kv_cache=torch.zeros(12, 2, 16, 8))  # content is not K|V
    assert paged_kv_views(layer) is None and impl.writes == 0


# --------------------------------------------------------------------------- the whole pass


@pytest.fixture(scope="module")
def adapter(tiny_model_dir):
    return HFAdapter.from_pretrained(str(tiny_model_dir("llama")))


def _fused_logits(adapter, backend_factory, selector):
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=5)
    precompute_case(engine, case)
    backend = backend_factory(len(case.token_ids)) if backend_factory else None
    result, _ = engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.15, attention_backend=backend)
    return result.logits, backend


def _slot_writing(adapter, impl_type, **kernels):
    shape = adapter.shape
    names = [f"layers.{i}.attn" for i in range(shape.num_layers)]

    def build(num_tokens):
        page_size, num_pages = 16, -(-num_tokens // 16) + 4
        layers = {name: make_layer(impl_type(shape.head_dim), num_pages, page_size, shape.num_kv_heads,
                                   shape.head_dim) for name in names}
        pages = torch.randperm(num_pages)[: -(-num_tokens // page_size)]  # scattered blocks
        positions = torch.arange(num_tokens)
        slots = pages[positions // page_size] * page_size + positions % page_size
        return SlotWritingAttention(layers, names, slots, shape.scaling, **kernels)
    return build


@pytest.mark.parametrize("selector", ["cacheblend", "epic"])
def test_rows_read_from_the_pages_equal_the_contiguous_pass(adapter, selector):
    plain, _ = _fused_logits(adapter, None, selector)
    logits, backend = _fused_logits(adapter, _slot_writing(adapter, FlashLayoutImpl), selector)
    assert backend.read_in_place and all(backend.read_in_place.values())
    assert torch.equal(logits, plain)


def test_negative_control_refused_layout_reads_contiguous_and_still_equals(adapter):
    plain, _ = _fused_logits(adapter, None, "cacheblend")
    logits, backend = _fused_logits(adapter, _slot_writing(adapter, OffByOneImpl), "cacheblend")
    assert backend.read_in_place and not any(backend.read_in_place.values())
    assert torch.equal(logits, plain)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel runs on CPU interpreted")
def test_triton_kernel_reads_the_pages_in_the_pass(adapter):
    tri_attn = pytest.importorskip("csrc_triton.sparse_attention")

    def kernel(q, q_positions, k_cache, v_cache, key_slots, scale, block_rows):
        return tri_attn.slot_rows_attention(q, q_positions, k_cache, v_cache, key_slots, scale)

    plain, _ = _fused_logits(adapter, None, "cacheblend")
    logits, backend = _fused_logits(adapter, _slot_writing(adapter, FlashLayoutImpl, slot_rows_attention=kernel),
                                    "cacheblend")
    assert all(backend.read_in_place.values())
    torch.testing.assert_close(logits, plain, **TOL[torch.float32])

"""The blend pass over vLLM's own Triton attention backend (TRITON_ATTN, a GPU backend), interpreted on CPU.

tests/vllm/test_cache_views.py proves the in-place reads against a torch copy of FlashAttention's writer;
here the layers are vLLM 0.32.0's `TritonAttentionImpl` with its real kernels (tests/helpers/vllm_triton.py):
its `do_kv_cache_update` (`triton_reshape_and_cache_flash`) writes every layer of the pass, and its
`forward` (`unified_attention`, what vLLM decodes with) reads them back.

- The probe proves this backend's layout, token-major and head-major, and the views read what its
  writer stored.
- A fused prefill through `SlotWritingAttention` over these layers reads every selected row's keys in
  place and gives the contiguous pass's logits bit for bit.
- After the pass, vLLM's own decode attention over the request's pages equals attention over the
  pass's K/V in every layer: what vLLM reads next is what the pass computed, at the right positions.
  Negative control: a block table whose first page is one the pass never wrote reads something else
  (swapping two full pages would not do: attention does not see the order of its keys).
"""

from __future__ import annotations

import pytest
import torch

from cachefuse.adapters.hf import HFAdapter
from cachefuse.attention import causal_attention
from cachefuse.vllm import cache_views
from cachefuse.vllm.cache_views import paged_kv_views
from cachefuse.vllm.paged import SlotWritingAttention
from tests.helpers.fusion import make_case, make_engine, precompute_case
from tests.helpers.tolerances import TOL
from tests.helpers.vllm_triton import decode_attention, triton_layer, vllm_triton_backend

PAGE_SIZE = 16


@pytest.fixture(scope="module")
def triton_attn():
    yield from vllm_triton_backend()


@pytest.fixture(autouse=True)
def fresh_verdicts():
    cache_views._verdicts.clear()
    yield
    cache_views._verdicts.clear()


@pytest.fixture(scope="module")
def adapter(tiny_model_dir):
    return HFAdapter.from_pretrained(str(tiny_model_dir("llama")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
def test_probe_proves_the_triton_backend_and_views_read_its_writes(triton_attn, head_major, dtype):
    layer = triton_layer(triton_attn, num_heads=4, num_kv_heads=2, head_dim=32, num_pages=6, head_major=head_major,
                         dtype=dtype)
    views = paged_kv_views(layer)
    assert views is not None and views[0].shape == (6, PAGE_SIZE, 2, 32)
    assert torch.count_nonzero(layer.kv_cache) == 0  # the probe wrote a scratch cache
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(37, 2, 32, generator=g).to(dtype), torch.randn(37, 2, 32, generator=g).to(dtype)
    slots = torch.randperm(6 * PAGE_SIZE, generator=g)[:37]
    layer.impl.do_kv_cache_update(layer, k, v, layer.kv_cache, slots)
    pages, offsets = slots // PAGE_SIZE, slots % PAGE_SIZE
    assert torch.equal(views[0][pages, offsets], k) and torch.equal(views[1][pages, offsets], v)


def _request_slots(num_tokens: int, num_pages: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block table, slot of every position 0..num_tokens-1): the request's pages, scattered."""
    pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))[: -(-num_tokens // PAGE_SIZE)]
    positions = torch.arange(num_tokens)
    return pages, pages[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE


def _passes(adapter, triton_attn, selector):
    """The contiguous pass and the pass over Triton-backend layers of the same prompt and store; the
    latter's layers, block table and slots (one position beyond the prompt for a decode step)."""
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=5)
    precompute_case(engine, case, with_hole=False)
    plain, _ = engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.15, save_holes=False)
    shape, num_tokens = adapter.shape, len(case.token_ids)
    num_pages = -(-(num_tokens + 1) // PAGE_SIZE) + 3
    names = [f"layers.{i}.attn" for i in range(shape.num_layers)]
    layers = {name: triton_layer(triton_attn, shape.num_heads, shape.num_kv_heads, shape.head_dim, num_pages)
              for name in names}
    block_table, slots = _request_slots(num_tokens + 1, num_pages, seed=7)
    backend = SlotWritingAttention(layers, names, slots, shape.scaling)
    fused, _ = engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.15, save_holes=False,
                              attention_backend=backend)
    return plain, fused, backend, [layers[name] for name in names], block_table, slots


@pytest.mark.parametrize("selector", ["cacheblend", "epic"])
def test_pass_over_the_triton_backend_reads_in_place_and_equals_the_contiguous_pass(adapter, triton_attn, selector):
    plain, fused, backend, *_ = _passes(adapter, triton_attn, selector)
    assert backend.read_in_place and all(backend.read_in_place.values())
    assert torch.equal(fused.logits, plain.logits)


def test_vllm_decodes_over_exactly_what_the_pass_computed(adapter, triton_attn):
    plain, _, _, layers, block_table, slots = _passes(adapter, triton_attn, "cacheblend")
    shape, num_tokens = adapter.shape, plain.k[0].shape[0]
    g = torch.Generator().manual_seed(11)
    unwritten = next(p for p in range(layers[0].kv_cache.shape[0]) if p not in block_table.tolist())
    first_page_lost = block_table.clone()
    first_page_lost[0] = unwritten  # positions 0..15 read from a page the pass never wrote
    for layer_index, layer in enumerate(layers):
        q = torch.randn(1, shape.num_heads, shape.head_dim, generator=g)
        k_new = torch.randn(1, shape.num_kv_heads, shape.head_dim, generator=g)
        v_new = torch.randn(1, shape.num_kv_heads, shape.head_dim, generator=g)
        layer.impl.do_kv_cache_update(layer, k_new, v_new, layer.kv_cache, slots[num_tokens:])
        k = torch.cat([plain.k[layer_index], k_new])
        v = torch.cat([plain.v[layer_index], v_new])
        # the new token's row of full causal attention over the pass's K/V and its own
        q_all = torch.zeros(num_tokens + 1, shape.num_heads, shape.head_dim)
        q_all[-1] = q[0]
        expected = causal_attention(q_all, k, v, shape.scaling)[-1:]
        torch.testing.assert_close(decode_attention(triton_attn, layer, q, num_tokens, block_table), expected,
                                   **TOL[torch.float32])
        misread = decode_attention(triton_attn, layer, q, num_tokens, first_page_lost)
        assert not torch.allclose(misread, expected, **TOL[torch.float32])

"""csrc_triton.sparse_attention.slot_rows_attention (keys read from a paged cache through their slots)
against its torch twin, cachefuse.attention.slot_rows_attention, and against rows_attention over the
same keys laid out contiguously.

The cache is vLLM's FlashAttention layout: a per-layer tensor of logical shape [pages, kv_heads,
page_size, 2 * head_dim] stored page-major then token-major (LBNHC), whose K and V are the strided views
`cache.transpose(1, 2).split(head_dim, -1)`, [pages, page_size, kv_heads, head_dim] each. A request's
keys sit in scattered slots of scattered pages, as a block table would place them. Devices and
tolerances as in test_sparse_attention.py.
"""

import pytest
import torch

from cachefuse import attention, ops
from tests.csrc_triton.test_sparse_attention import make_rows_case
from tests.helpers.tolerances import TOL
from tests.helpers.triton_devices import kernel_devices

DEVICES = kernel_devices()
tri_attn = pytest.importorskip("csrc_triton.sparse_attention")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def flash_layout_cache(k, v, page_size, num_pages, seed=0):
    """k, v [N, Hkv, D] scattered into a FlashAttention-layout cache -> (k_cache, v_cache, key_slots)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    physical = torch.zeros(num_pages, page_size, num_kv_heads, 2 * head_dim, dtype=k.dtype, device=k.device)
    cache = physical.permute(0, 2, 1, 3)  # logical [pages, Hkv, page_size, 2D], physical LBNHC
    k_cache, v_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(num_pages, generator=g)[: -(-num_tokens // page_size)]  # the request's block table
    positions = torch.arange(num_tokens)
    key_slots = (pages[positions // page_size] * page_size + positions % page_size).to(k.device)
    k_cache[key_slots // page_size, key_slots % page_size] = k
    v_cache[key_slots // page_size, key_slots % page_size] = v
    return k_cache, v_cache, key_slots


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [(1, 1), (1, 40), (7, 67), (65, 299)], ids=lambda s: f"r{s[0]}n{s[1]}")
@pytest.mark.parametrize("group", [1, 3], ids=["mha", "gqa3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_slot_rows_attention_matches_twin_and_contiguous(device, size, group, dtype):
    q, positions, k, v, scale = make_rows_case(*size, group, dtype, device)
    k_cache, v_cache, key_slots = flash_layout_cache(k, v, page_size=16, num_pages=40)
    expected = attention.slot_rows_attention(q, positions, k_cache, v_cache, key_slots, scale)
    torch.testing.assert_close(expected, attention.rows_attention(q, positions, k, v, scale), rtol=0, atol=0)
    actual = tri_attn.slot_rows_attention(q, positions, k_cache, v_cache, key_slots, scale)
    assert actual.dtype == dtype and actual.shape == q.shape
    torch.testing.assert_close(actual, expected, **TOL[dtype])
    # the same kernel over the contiguous keys: the slots change where keys are read, not the result
    torch.testing.assert_close(actual, tri_attn.rows_attention(q, positions, k, v, scale), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 5, 32])
def test_slot_rows_attention_page_sizes(device, page_size):
    """A page of one token, an odd page that rows straddle, and a page larger than a key tile's half."""
    q, positions, k, v, scale = make_rows_case(9, 83, 2, torch.float32, device)
    k_cache, v_cache, key_slots = flash_layout_cache(k, v, page_size, num_pages=-(-83 // page_size) + 3)
    expected = attention.rows_attention(q, positions, k, v, scale)
    actual = tri_attn.slot_rows_attention(q, positions, k_cache, v_cache, key_slots, scale)
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_slot_rows_attention_long_context(device, dtype):
    q, positions, k, v, scale = make_rows_case(600, 8191, 4, dtype, device, head_dim=128)
    k_cache, v_cache, key_slots = flash_layout_cache(k, v, page_size=16, num_pages=600)
    expected = attention.slot_rows_attention(q, positions, k_cache, v_cache, key_slots, scale)
    actual = tri_attn.slot_rows_attention(q, positions, k_cache, v_cache, key_slots, scale)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_negative_control_wrong_slots_differ(device):
    """Keys read one slot off (the next token's key) must change the output: the slots are what is read."""
    q, positions, k, v, scale = make_rows_case(7, 67, 2, torch.float32, device)
    k_cache, v_cache, key_slots = flash_layout_cache(k, v, page_size=16, num_pages=10)
    right = tri_attn.slot_rows_attention(q, positions, k_cache, v_cache, key_slots, scale)
    wrong = tri_attn.slot_rows_attention(q, positions, k_cache, v_cache, key_slots.roll(1), scale)
    assert (right - wrong).abs().max() > 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_slot_rows_attention_rejects_bad_arguments(device):
    q, positions, k, v, scale = make_rows_case(3, 20, 1, torch.float32, device)
    k_cache, v_cache, key_slots = flash_layout_cache(k, v, page_size=8, num_pages=4)
    with pytest.raises(ValueError, match="key_slots"):
        tri_attn.slot_rows_attention(q, positions, k_cache, v_cache, key_slots.int(), scale)
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        tri_attn.slot_rows_attention(q, positions, k_cache[0], v_cache[0], key_slots, scale)


@pytest.mark.parametrize("device", DEVICES)
def test_ops_dispatch(device):
    """ops runs the kernel for CUDA tensors and the twin (bit-equal) everywhere else."""
    q, positions, k, v, scale = make_rows_case(7, 41, 2, torch.float32, device)
    k_cache, v_cache, key_slots = flash_layout_cache(k, v, page_size=16, num_pages=5)
    got = ops.slot_rows_attention(q, positions, k_cache, v_cache, key_slots, scale)
    reference = (tri_attn.slot_rows_attention(q, positions, k_cache, v_cache, key_slots, scale) if device == "cuda"
                 else attention.slot_rows_attention(q, positions, k_cache, v_cache, key_slots, scale))
    torch.testing.assert_close(got, reference, rtol=0, atol=0)

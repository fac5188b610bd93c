"""rows_attention: exact per-query causal mask; a poisoned future key never reaches earlier rows,
and a bottom-right-aligned mask (the CacheBlend prototype's) would let it through."""

import pytest
import torch
import torch.nn.functional as F

from cachefuse.attention import causal_attention, rows_attention


def bottom_right_attention(q, q_positions, k, v, scale, block_rows=64):
    """The wrong mask: row i of R sees keys <= N - R + i (exact only for a contiguous suffix)."""
    num_rows, num_keys = q.shape[0], k.shape[0]
    mask = torch.arange(num_keys)[None, :] <= (num_keys - num_rows + torch.arange(num_rows))[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask[None, None], scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def make(num_tokens=97, rows=(3, 10, 11, 40, 41, 42, 80, 96), heads=4, kv_heads=2, head_dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_positions = torch.tensor(rows)
    q = torch.randn(len(rows), heads, head_dim, generator=g)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=g)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=g)
    return q, q_positions, k, v


@pytest.mark.parametrize("block_rows", [1, 3, 64])
def test_rows_attention_equals_rows_of_full_causal(block_rows):
    q_all = torch.randn(97, 4, 16, generator=torch.Generator().manual_seed(1))
    _, _, k, v = make()
    rows = torch.tensor([0, 5, 6, 50, 96])
    full = causal_attention(q_all, k, v, 0.25)
    out = rows_attention(q_all[rows], rows, k, v, 0.25, block_rows)
    torch.testing.assert_close(out, full[rows], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("block_rows", [2, 64])
def test_poisoned_future_key_is_invisible(block_rows):
    q, q_positions, k, v = make()
    poison_at = 30  # after rows 3, 10, 11; before 40...
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[poison_at], v_bad[poison_at] = 50.0, 1e3
    clean = rows_attention(q, q_positions, k, v, 0.25, block_rows)
    poisoned = rows_attention(q, q_positions, k_bad, v_bad, 0.25, block_rows)
    early = q_positions < poison_at
    torch.testing.assert_close(poisoned[early], clean[early], atol=0, rtol=0)
    assert not torch.allclose(poisoned[~early], clean[~early])  # the later rows do see it


def test_bottom_right_mask_fails_the_same_check():
    q, q_positions, k, v = make()
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[30], v_bad[30] = 50.0, 1e3
    clean = bottom_right_attention(q, q_positions, k, v, 0.25)
    poisoned = bottom_right_attention(q, q_positions, k_bad, v_bad, 0.25)
    early = q_positions < 30
    assert not torch.allclose(poisoned[early], clean[early])

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


def windowed_reference(q_all, k, v, scale, window):
    """Row by row, each query's softmax over exactly keys p - window + 1 .. p (written without masks)."""
    out = torch.empty_like(q_all)
    group = q_all.shape[1] // k.shape[1]
    for p in range(q_all.shape[0]):
        first = max(0, p - window + 1)
        keys = k[first:p + 1].repeat_interleave(group, dim=1)  # [n, heads, head_dim]
        values = v[first:p + 1].repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q_all[p], keys) * scale, dim=-1)
        out[p] = torch.einsum("hn,nhd->hd", weights, values)
    return out


@pytest.mark.parametrize("window", [1, 7, 40])
def test_causal_attention_with_window_equals_row_by_row_reference(window):
    q_all = torch.randn(97, 4, 16, generator=torch.Generator().manual_seed(2))
    _, _, k, v = make()
    expected = windowed_reference(q_all, k, v, 0.25, window)
    torch.testing.assert_close(causal_attention(q_all, k, v, 0.25, window), expected, atol=1e-5, rtol=1e-5)
    # negative control: the same prompt without the window differs on every row past the window
    plain = causal_attention(q_all, k, v, 0.25)
    assert (plain[window:] - expected[window:]).abs().amax(dim=(1, 2)).min() > 1e-4


@pytest.mark.parametrize("window", [1, 5, 30, 200])
@pytest.mark.parametrize("block_rows", [1, 3, 64])
def test_rows_attention_with_window_equals_rows_of_windowed_causal(window, block_rows):
    q_all = torch.randn(97, 4, 16, generator=torch.Generator().manual_seed(1))
    _, _, k, v = make()
    rows = torch.tensor([0, 5, 6, 50, 51, 90, 96])
    full = causal_attention(q_all, k, v, 0.25, window)
    out = rows_attention(q_all[rows], rows, k, v, 0.25, block_rows, window)
    torch.testing.assert_close(out, full[rows], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("block_rows", [2, 64])
def test_key_just_outside_the_window_is_invisible(block_rows):
    """A poisoned key at position 30 reaches rows 30..30+W-1 only; without the window every later row
    sees it (the negative control)."""
    q, q_positions, k, v = make(rows=(3, 29, 30, 33, 36, 37, 80))
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[30], v_bad[30] = 50.0, 1e3
    window = 7  # row 36 sees 30..36; row 37 sees 31..37
    clean = rows_attention(q, q_positions, k, v, 0.25, block_rows, window)
    poisoned = rows_attention(q, q_positions, k_bad, v_bad, 0.25, block_rows, window)
    sees = (q_positions >= 30) & (q_positions <= 36)
    torch.testing.assert_close(poisoned[~sees], clean[~sees], atol=0, rtol=0)
    assert (poisoned[sees] - clean[sees]).abs().amax(dim=(1, 2)).min() > 1.0
    unwindowed = rows_attention(q, q_positions, k_bad, v_bad, 0.25, block_rows)
    late = q_positions > 36
    assert (unwindowed[late] - clean[late]).abs().amax(dim=(1, 2)).min() > 1.0


def test_varlen_and_slot_rows_attention_apply_the_window():
    """The packed and the paged twins give each request what rows_attention gives it alone."""
    from cachefuse.attention import slot_rows_attention, varlen_rows_attention

    q_a, pos_a, k_a, v_a = make(num_tokens=50, rows=(0, 20, 49), seed=3)
    q_b, pos_b, k_b, v_b = make(num_tokens=97, seed=4)
    window = 9
    out = varlen_rows_attention(torch.cat([q_a, q_b]), torch.cat([pos_a, pos_b]), torch.tensor([0, 3, 11]),
                                torch.cat([k_a, k_b]), torch.cat([v_a, v_b]), torch.tensor([0, 50, 147]), 0.25,
                                window=window)
    torch.testing.assert_close(out[:3], rows_attention(q_a, pos_a, k_a, v_a, 0.25, window=window), atol=0, rtol=0)
    torch.testing.assert_close(out[3:], rows_attention(q_b, pos_b, k_b, v_b, 0.25, window=window), atol=0, rtol=0)
    page_size = 8
    slots = torch.randperm(16 * page_size, generator=torch.Generator().manual_seed(5))[:97]
    k_cache = torch.zeros(16, page_size, 2, 16)
    v_cache = torch.zeros(16, page_size, 2, 16)
    k_cache[slots // page_size, slots % page_size], v_cache[slots // page_size, slots % page_size] = k_b, v_b
    paged = slot_rows_attention(q_b, pos_b, k_cache, v_cache, slots, 0.25, window=window)
    torch.testing.assert_close(paged, out[3:], atol=0, rtol=0)

"""Attention for the blend pass, pure torch: full causal, and selected rows over a merged K/V.

Imports only torch. `rows_attention` is the specification (and CPU path) of the sparse-query
attention kernel: a query at position p sees exactly the keys at positions <= p, whatever rows
were selected around it. Rows are processed in sorted blocks, each attending only to keys up to
its last row's position (key truncation), which an early prototype measured as
the fastest exact variant on CPU (10-30% below one dense [R x N] mask).

Every function takes the layer's sliding window (`window`, None: none), with the meaning transformers
and vLLM give it: a query at p sees the `window` keys at positions p - window + 1 .. p, itself included.

```
keys  | never seen            | seen by the row at p        | never seen (future) |
      0              p - window + 1                         p                    N
```
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """Plain causal attention over a whole prompt.

    Args:
        q: [num_tokens, num_heads, head_dim]
        k, v: [num_tokens, num_kv_heads, head_dim] (GQA: num_heads a multiple of num_kv_heads)
        scale: softmax scale.
        window: sliding window (keys a row sees, itself included); None: every earlier key.

    Returns:
        [num_tokens, num_heads, head_dim]
    """
    mask = None
    if window is not None and window < q.shape[0]:  # a window as long as the prompt changes nothing
        positions = torch.arange(q.shape[0], device=q.device)
        mask = visible_keys(positions, positions, window)[None, None]  # [1, 1, T, T]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def visible_keys(q_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """bool [num_rows, num_keys]: key j is visible to row i (causal, within the window when there is one)."""
    visible = key_positions[None, :] <= q_positions[:, None]
    if window is not None:
        visible &= key_positions[None, :] > q_positions[:, None] - window
    return visible


def rows_attention(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    block_rows: int = 64,
    window: int | None = None,
) -> torch.Tensor:
    """Selected query rows over a full-length merged K/V with an exact per-query causal mask.

    Args:
        q: [num_rows, num_heads, head_dim].
        q_positions: int64 [num_rows], in any order; key j is visible to row i iff j <= q_positions[i]
            (and, with a window, j > q_positions[i] - window).
        k, v: [num_tokens, num_kv_heads, head_dim], key j at position j.
        scale: softmax scale.
        block_rows: rows per SDPA call.
        window: the layer's sliding window; None: none.

    Returns:
        [num_rows, num_heads, head_dim]
    """
    key_positions = torch.arange(k.shape[0], device=k.device)
    return rows_attention_at(q, q_positions, k, v, key_positions, scale, block_rows, window)


def varlen_rows_attention(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    cu_rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_keys: torch.Tensor,
    scale: float,
    block_rows: int = 64,
    window: int | None = None,
) -> torch.Tensor:
    """`rows_attention` for several requests packed together, one request at a time.

    Request b owns query rows [cu_rows[b], cu_rows[b+1]) and keys [cu_keys[b], cu_keys[b+1]); its
    q_positions are relative to its first key. The specification of the kernel's varlen launch.

    Args:
        q: [total_rows, num_heads, head_dim]; q_positions: int64 [total_rows], sorted within a request.
        cu_rows, cu_keys: int [B+1] offsets, non-decreasing, starting at 0.
        k, v: [total_keys, num_kv_heads, head_dim].
        scale: softmax scale.
        block_rows: rows per SDPA call.
        window: the layer's sliding window (every request's); None: none.

    Returns:
        [total_rows, num_heads, head_dim]
    """
    out = q.new_empty(q.shape)
    rows, keys = cu_rows.tolist(), cu_keys.tolist()
    for row_begin, row_end, key_begin, key_end in zip(rows[:-1], rows[1:], keys[:-1], keys[1:], strict=True):
        if row_end > row_begin:
            out[row_begin:row_end] = rows_attention(
                q[row_begin:row_end], q_positions[row_begin:row_end],
                k[key_begin:key_end], v[key_begin:key_end], scale, block_rows, window)
    return out


def slot_rows_attention(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_slots: torch.Tensor,
    scale: float,
    block_rows: int = 64,
    window: int | None = None,
) -> torch.Tensor:
    """`rows_attention` over keys that live in a paged cache: key j (position j) is in slot `key_slots[j]`,
    page `key_slots[j] // page_size`, offset `key_slots[j] % page_size` (vLLM's slot numbering).

    Args:
        q: [num_rows, num_heads, head_dim]; q_positions: sorted int64 [num_rows], each < num_keys.
        k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim], any strides.
        key_slots: int64 [num_keys], distinct.
        window: the layer's sliding window; None: none.

    Returns:
        [num_rows, num_heads, head_dim]
    """
    page_size = k_cache.shape[1]
    pages, offsets = key_slots // page_size, key_slots % page_size
    # gathers num_keys rows of k and v into contiguous copies; the kernel reads them in place
    return rows_attention(q, q_positions, k_cache[pages, offsets], v_cache[pages, offsets], scale, block_rows,
                          window)


def rows_attention_at(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float,
    block_rows: int = 64,
    window: int | None = None,
) -> torch.Tensor:
    """`rows_attention` over a subset of a prompt's keys: key j sits at `key_positions[j]`, not at j.

    The question probe attends over a view (system, anchors, forced rows) whose positions have gaps.

    Args:
        q: [num_rows, num_heads, head_dim]; q_positions: int64 [num_rows], in any order (the fusor's are
            sorted; each block's keys reach its furthest row).
        k, v: [num_keys, num_kv_heads, head_dim]; key_positions: sorted int64 [num_keys], distinct.
        window: the layer's sliding window; None: none.

    Returns:
        [num_rows, num_heads, head_dim]; key j is visible to row i iff key_positions[j] <= q_positions[i]
        (and, with a window, key_positions[j] > q_positions[i] - window).
    """
    out = q.new_empty(q.shape)
    ends = _block_ends(q.shape[0], block_rows)
    # Keys each block sees, up to its furthest row (rows in any order, as the kernel takes them), read to
    # the host once per call (on a GPU: one sync, not one per block). With a window, keys before the
    # nearest row's window are cut off too.
    padded = F.pad(q_positions, (0, -q.shape[0] % block_rows), value=-1).view(-1, block_rows)
    block_ends = torch.searchsorted(key_positions, padded.amax(dim=1), right=True)
    block_begins = torch.zeros_like(block_ends)
    if window is not None:
        nearest = padded.masked_fill(padded < 0, torch.iinfo(padded.dtype).max).amin(dim=1)
        block_begins = torch.searchsorted(key_positions, nearest - window + 1)
    bounds = torch.stack([block_begins, block_ends], dim=1).tolist()
    for begin, end, (key_begin, key_end) in zip(range(0, q.shape[0], block_rows), ends, bounds, strict=True):
        keys = slice(key_begin, key_end)
        mask = visible_keys(q_positions[begin:end], key_positions[keys], window)  # [block, keys]
        block = F.scaled_dot_product_attention(
            q[begin:end].transpose(0, 1)[None],
            k[keys].transpose(0, 1)[None],
            v[keys].transpose(0, 1)[None],
            attn_mask=mask[None, None], scale=scale, enable_gqa=True)
        out[begin:end] = block[0].transpose(0, 1)
    return out


def _block_ends(num_rows: int, block_rows: int) -> list[int]:
    """Exclusive end of each block of `block_rows` rows."""
    return [min(begin + block_rows, num_rows) for begin in range(0, num_rows, block_rows)]


def segment_attention_mass(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    k: torch.Tensor,
    segment_of_key: torch.Tensor,
    num_segments: int,
    scale: float,
    block_rows: int = 64,
    per_row: bool = False,
    window: int | None = None,
) -> torch.Tensor:
    """Softmax attention mass each segment of keys receives from the given rows, summed over rows.

    The Cache-Craft statistics (inter/intra attention) of a chunk computed in full: per segment, the
    attention weights from the chunk's rows to that segment's keys, with the exact per-query causal
    mask, computed in row blocks so no [rows x keys] matrix larger than a block is held.

    Args:
        q: [num_rows, num_heads, head_dim]; q_positions: sorted int64 [num_rows].
        k: [num_tokens, num_kv_heads, head_dim]; segment_of_key: int64 [num_tokens], each key's segment.
        num_segments: S.
        window: the layer's sliding window (its keys outside get no mass); None: none.

    Returns:
        [num_heads, S] fp32: per head, the summed mass on each segment (each row's weights sum to 1);
        with `per_row=True`, [num_rows, num_heads, S] (not summed over rows).
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    k_heads = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, num_tokens, head_dim]
    key_ids = torch.arange(k.shape[0], device=k.device)
    mass = torch.zeros(q.shape[0], num_heads, num_segments, dtype=torch.float32, device=q.device)
    ends = _block_ends(q.shape[0], block_rows)
    block_keys = (q_positions[[e - 1 for e in ends]] + 1).tolist()  # one host read per call
    for begin, end, num_keys in zip(range(0, q.shape[0], block_rows), ends, block_keys, strict=True):
        scores = torch.einsum("rhd,hkd->hrk", q[begin:end].float(), k_heads[:, :num_keys]) * scale
        visible = visible_keys(q_positions[begin:end], key_ids[:num_keys], window)  # [block, num_keys]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)  # [heads, block, keys]
        block = torch.zeros(num_heads, end - begin, num_segments, dtype=torch.float32, device=q.device)
        block.index_add_(2, segment_of_key[:num_keys], probs)  # [heads, block, segments]
        mass[begin:end] = block.transpose(0, 1)
    return mass if per_row else mass.sum(dim=0)

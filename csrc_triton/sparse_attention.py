"""Sparse-query attention as a Triton kernel; its torch twin and specification is
cachefuse.attention.rows_attention (varlen_rows_attention for several requests, slot_rows_attention
for keys read from a paged cache through their slots).

Imports torch and triton only. Nothing runs at import time. CPU tensors need TRITON_INTERPRET=1 set
before this module is imported (triton.jit reads it when decorating).

Selected query rows attend over a full-length K/V with an exact per-query causal mask: key j is
visible to row i iff j <= q_positions[i]. Flash-attention style: one program owns BLOCK_M rows of one
query head, streams BLOCK_N keys at a time through an fp32 online softmax, and stops at the largest
position among its rows (causal truncation). Keys below the smallest position of the block are
visible to every row and run without the mask; only the band between the smallest and the largest
position pays for the per-query mask. Rows need not be sorted for exactness (the block's min and max
are read, not its ends), but sorted rows make the bands narrow.

```
keys  | unmasked: j <= min pos of block | masked band        | never read        |
      0                                 min                max+1               N
```

With a sliding window W (key j visible to row i iff q_positions[i] - W < j <= q_positions[i], as
transformers and vLLM mean it) the stream starts at the block's smallest position minus W - 1 and every
tile is masked: a windowed layer's rows read at most W + (max pos - min pos) keys.

Traffic per (row block, head): reads BLOCK_M*D of q and (max pos + 1)*D each of k and v, writes
BLOCK_M*D (slotted: plus max pos + 1 int64 slots, each key row gathered from its page). K/V tiles are shared through L2 by the GROUP query heads of one KV head and by the row
blocks of a request.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, offs_m, pos, start_n,
    k_base, v_base, num_keys,
    stride_k_tok, stride_v_tok,
    slots_base, page_size, stride_k_page, stride_v_page,
    qk_scale, window,
    offs_d, d_mask,
    SLOTTED: tl.constexpr,
    MASKED: tl.constexpr,
    WINDOWED: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # reads BLOCK_N*D of k and of v (and BLOCK_N slots); one [BLOCK_M, BLOCK_N] score tile in registers.
    keys = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    key_mask = keys < num_keys
    kv_mask = key_mask[:, None] & d_mask[None, :]
    if SLOTTED:  # key j lives in page slots[j] // page_size at offset slots[j] % page_size
        slot = tl.load(slots_base + keys, mask=key_mask, other=0)
        page, in_page = slot // page_size, slot % page_size
        k_rows = page * stride_k_page + in_page * stride_k_tok
        v_rows = page * stride_v_page + in_page * stride_v_tok
    else:
        k_rows = keys.to(tl.int64) * stride_k_tok
        v_rows = keys.to(tl.int64) * stride_v_tok
    k = tl.load(k_base + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    qk = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_FP32)  # [BLOCK_M, BLOCK_N]
    qk = qk * qk_scale  # log2 domain: exp2(x * log2e) == exp(x)
    if MASKED:
        visible = (keys[None, :] <= pos[:, None]) & key_mask[None, :]
        if WINDOWED:
            visible = visible & (keys[None, :] > pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_shift = m_new
    if WINDOWED:  # a row may see no key of this tile nor of those before: -inf - -inf would be NaN
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_shift)
    p = tl.math.exp2(qk - m_shift[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = _dot(p.to(v.dtype), v, acc, DOT_FP32)
    return acc, m_new, l_i


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    # DOT_FP32: fp32 inputs (no TF32), or the interpreter, whose tl.dot multiplies bf16 bit patterns
    # as integers; bf16 and fp16 products are exact in fp32, so this is the tensor cores' arithmetic.
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _rows_attention_kernel(
    q_ptr, pos_ptr, k_ptr, v_ptr, out_ptr,
    cu_rows_ptr, cu_keys_ptr, slots_ptr,
    num_rows, num_keys, group,
    stride_q_tok, stride_q_head,
    stride_k_tok, stride_k_head,
    stride_v_tok, stride_v_head,
    stride_out_tok, stride_out_head,
    page_size, stride_k_page, stride_v_page,
    qk_scale, window,
    HEAD_DIM: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    SLOTTED: tl.constexpr,
    WINDOWED: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program: BLOCK_M rows of one query head of one request.
    # reads BLOCK_M*D of q, (max pos + 1)*D of k and of v; writes BLOCK_M*D.
    head = tl.program_id(1)
    if IS_VARLEN:
        req = tl.program_id(2)
        row_start = tl.load(cu_rows_ptr + req)
        num_rows = tl.load(cu_rows_ptr + req + 1) - row_start
        key_start = tl.load(cu_keys_ptr + req)
        num_keys = tl.load(cu_keys_ptr + req + 1) - key_start
    else:
        row_start = 0
        key_start = 0
    # Heaviest blocks (the last rows, which see the most keys) are launched first.
    block_m = tl.num_programs(0) - 1 - tl.program_id(0)
    if block_m * BLOCK_M >= num_rows:
        return
    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M], rows within the request
    row_mask = offs_m < num_rows
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    # Padding rows get position 0: they see key 0 (never an empty softmax) and are not stored.
    pos = tl.load(pos_ptr + row_start + offs_m, mask=row_mask, other=0)  # [BLOCK_M] int64
    pos_lo = tl.min(tl.where(row_mask, pos, num_keys), 0)
    pos_hi = tl.max(pos, 0)
    end_n = tl.minimum(pos_hi + 1, num_keys)
    end_full = (tl.minimum(pos_lo + 1, end_n) // BLOCK_N) * BLOCK_N
    begin_masked = end_full
    if WINDOWED:  # no key is visible to every row for sure: stream the block's band, every tile masked
        end_full = 0
        begin_masked = (tl.maximum(pos_lo - window + 1, 0) // BLOCK_N) * BLOCK_N
        pos = tl.where(row_mask, pos, pos_lo)  # padding rows: a position whose window the stream covers

    q_rows = q_ptr + (row_start + offs_m)[:, None].to(tl.int64) * stride_q_tok + head * stride_q_head
    q = tl.load(q_rows + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    kv_head = head // group
    if SLOTTED:  # the request's keys are wherever its slots say; slots_ptr is indexed by key
        k_base = k_ptr + kv_head * stride_k_head
        v_base = v_ptr + kv_head * stride_v_head
    else:
        k_base = k_ptr + key_start.to(tl.int64) * stride_k_tok + kv_head * stride_k_head
        v_base = v_ptr + key_start.to(tl.int64) * stride_v_tok + kv_head * stride_v_head

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, end_full, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, offs_m, pos, start_n, k_base, v_base, num_keys,
            stride_k_tok, stride_v_tok, slots_ptr, page_size, stride_k_page, stride_v_page, qk_scale, window,
            offs_d, d_mask, SLOTTED=SLOTTED, MASKED=False, WINDOWED=False, DOT_FP32=DOT_FP32, BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N)
    for start_n in range(begin_masked, end_n, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, offs_m, pos, start_n, k_base, v_base, num_keys,
            stride_k_tok, stride_v_tok, slots_ptr, page_size, stride_k_page, stride_v_page, qk_scale, window,
            offs_d, d_mask, SLOTTED=SLOTTED, MASKED=True, WINDOWED=WINDOWED, DOT_FP32=DOT_FP32, BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N)

    out = acc / l_i[:, None]
    out_rows = out_ptr + (row_start + offs_m)[:, None].to(tl.int64) * stride_out_tok + head * stride_out_head
    tl.store(out_rows + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


def rows_attention(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Selected query rows over a full-length K/V; same contract as cachefuse.attention.rows_attention.

    Args:
        q: [num_rows, num_heads, head_dim], fp32 / fp16 / bf16, last dim contiguous.
        q_positions: int64 [num_rows] on q's device, sorted ascending, each in [0, num_tokens).
            Key j is visible to row i iff j <= q_positions[i].
        k, v: [num_tokens, num_kv_heads, head_dim] of q's dtype, key j at position j
            (GQA: num_heads a multiple of num_kv_heads).
        scale: softmax scale.
        window: sliding window (j also > q_positions[i] - window); None: none.

    Returns:
        A new contiguous [num_rows, num_heads, head_dim] tensor of q's dtype.
    """
    _check(q, q_positions, k, v, window)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0 or q.shape[1] == 0:
        return out
    _launch(q, q_positions, k, v, out, scale, window, None, None, q.shape[0])
    return out


def varlen_rows_attention(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    cu_rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_keys: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """`rows_attention` for several requests in one launch; twin: cachefuse.attention.varlen_rows_attention.

    Request b owns query rows [cu_rows[b], cu_rows[b+1]) and keys [cu_keys[b], cu_keys[b+1]):

    ```
    q, q_positions | req 0 rows | req 1 rows | ... |        k, v | req 0 keys     | req 1 keys | ... |
                   0       cu_rows[1]          cu_rows[B]            0           cu_keys[1]        cu_keys[B]
    ```

    Args:
        q: [total_rows, num_heads, head_dim]; q_positions: int64 [total_rows], relative to the
            request's first key, sorted ascending within each request.
        cu_rows, cu_keys: int32 or int64 [B+1] offsets, non-decreasing, starting at 0.
        k, v: [total_keys, num_kv_heads, head_dim].
        scale: softmax scale.
        window: sliding window of every request; None: none.

    Returns:
        A new contiguous [total_rows, num_heads, head_dim] tensor of q's dtype.
    """
    _check(q, q_positions, k, v, window)
    for name, cu in (("cu_rows", cu_rows), ("cu_keys", cu_keys)):
        if cu.dim() != 1 or cu.shape[0] < 1 or cu.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"expected int32/int64 {name} [B+1], got {cu.dtype} {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} on {cu.device}, q on {q.device}")
    if cu_rows.shape != cu_keys.shape:
        raise ValueError(f"cu_rows {tuple(cu_rows.shape)} and cu_keys {tuple(cu_keys.shape)} differ")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_requests = cu_rows.shape[0] - 1
    if q.shape[0] == 0 or q.shape[1] == 0 or num_requests == 0:
        return out
    # One host read sizes the grid and checks the offsets against the tensors (the kernel would read and
    # write past their ends; the twin slices): the largest request's rows, the last row and key offsets.
    max_rows, total_rows, total_keys = torch.stack([
        (cu_rows[1:] - cu_rows[:-1]).max().to(torch.int64), cu_rows[-1].to(torch.int64),
        cu_keys[-1].to(torch.int64)]).tolist()
    if total_rows != q.shape[0] or total_keys > k.shape[0]:
        raise ValueError(f"cu_rows ends at {total_rows} for {q.shape[0]} rows, cu_keys at {total_keys} for "
                         f"{k.shape[0]} keys: expected cu_rows[-1] == rows and cu_keys[-1] <= keys")
    _launch(q, q_positions, k, v, out, scale, window, cu_rows.contiguous(), cu_keys.contiguous(), max_rows)
    return out


def slot_rows_attention(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_slots: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """`rows_attention` over keys read from a paged cache; twin: cachefuse.attention.slot_rows_attention.

    Key j (at position j) lives in the cache's slot `key_slots[j]`: page `key_slots[j] // page_size`,
    offset `key_slots[j] % page_size`, vLLM's slot numbering. Each selected row reads its keys
    straight from the request's blocks; no contiguous copy of the prompt's K/V is made.

    Args:
        q: [num_rows, num_heads, head_dim], fp32 / fp16 / bf16, last dim contiguous.
        q_positions: int64 [num_rows], sorted ascending, each in [0, num_keys).
        k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim] of q's dtype, any page, token
            and head strides (vLLM's FlashAttention layout is a strided view), last dim contiguous.
        key_slots: int64 [num_keys] on q's device, distinct slots of the request's keys.
        scale: softmax scale.
        window: sliding window; None: none.

    Returns:
        A new contiguous [num_rows, num_heads, head_dim] tensor of q's dtype.
    """
    _check_paged(q, q_positions, k_cache, v_cache, key_slots, window)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0 or q.shape[1] == 0:
        return out
    paged = (key_slots.contiguous(), k_cache.shape[1], k_cache.stride(0), v_cache.stride(0))
    _launch(q, q_positions, k_cache, v_cache, out, scale, window, None, None, q.shape[0], paged)
    return out


def _check_paged(q, q_positions, k_cache, v_cache, key_slots, window) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"expected k_cache and v_cache [pages, page_size, Hkv, D], got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    _check(q, q_positions, k_cache[0], v_cache[0], window)
    if key_slots.dim() != 1 or key_slots.dtype != torch.int64 or key_slots.device != q.device:
        raise ValueError(f"expected int64 key_slots [num_keys] on {q.device}, got {key_slots.dtype} "
                         f"{tuple(key_slots.shape)} on {key_slots.device}")


def _check(q: torch.Tensor, q_positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           window: int | None = None) -> None:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"expected a sliding window of at least 1 key or None, got {window!r}")
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"expected q [R, Hq, D], k and v [N, Hkv, D], got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected fp32/fp16/bf16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"num_heads={q.shape[1]} is not a multiple of num_kv_heads={k.shape[1]}")
    if q.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim={q.shape[2]}, expected at most {MAX_HEAD_DIM}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"expected {name} with a contiguous last dim, got strides {x.stride()}")
    if q_positions.dtype != torch.int64 or tuple(q_positions.shape) != (q.shape[0],):
        raise ValueError(f"expected int64 q_positions [{q.shape[0]}], got {q_positions.dtype} "
                         f"{tuple(q_positions.shape)}")
    for name, x in (("q_positions", q_positions), ("k", k), ("v", v)):
        if x.device != q.device:
            raise ValueError(f"{name} on {x.device}, q on {q.device}")


def _launch(q, q_positions, k, v, out, scale, window, cu_rows, cu_keys, max_rows, paged=None) -> None:
    """`paged`: (key_slots, page_size, stride_k_page, stride_v_page) when k and v are paged caches."""
    head_dim = q.shape[2]
    block_m, block_n, num_warps, num_stages = _tiles(head_dim, max_rows, q.is_cuda)
    is_varlen = cu_rows is not None
    key_slots, page_size, stride_k_page, stride_v_page = paged if paged is not None else (None, 1, 0, 0)
    num_keys = key_slots.shape[0] if paged is not None else k.shape[0]
    grid = (triton.cdiv(max_rows, block_m), q.shape[1], cu_rows.shape[0] - 1 if is_varlen else 1)
    _rows_attention_kernel[grid](
        q, q_positions.contiguous(), k, v, out,
        cu_rows, cu_keys, key_slots,
        q.shape[0], num_keys, q.shape[1] // k.shape[-2],
        q.stride(0), q.stride(1), k.stride(-3), k.stride(-2),
        v.stride(-3), v.stride(-2), out.stride(0), out.stride(1),
        page_size, stride_k_page, stride_v_page,
        float(scale) * LOG2E, 0 if window is None else window,
        HEAD_DIM=head_dim,
        IS_VARLEN=is_varlen,
        SLOTTED=paged is not None,
        WINDOWED=window is not None,
        DOT_FP32=q.dtype == torch.float32 or _interpreted(),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        num_warps=num_warps,
        num_stages=num_stages,
    )


def _tiles(head_dim: int, max_rows: int, is_cuda: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): tl.dot needs every tile side >= 16."""
    if not is_cuda:
        return 16, 32, 4, 1  # interpreter: small tiles waste the least work on odd sizes
    block_m = 64 if max_rows > 16 else 16
    if head_dim > 128:
        return block_m, 32, 4, 2
    return block_m, 64, 4, 3


def _interpreted() -> bool:
    """True when triton.jit produced an interpreter function (TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_rows_attention_kernel, InterpretedFunction)

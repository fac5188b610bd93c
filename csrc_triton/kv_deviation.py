"""Per-row squared L2 distance of two K or V tensors, as one Triton kernel: CacheBlend's deviation
reduction. Its torch twin and specification is cachefuse.deviation.row_sq_dist.

Imports torch and triton only. Nothing runs at import time. CPU tensors need TRITON_INTERPRET=1 set
before this module is imported (triton.jit reads it when decorating).

Traffic: reads R*H*D elements of each of a and b, writes R fp32. The torch twin materialises the
fp32 difference and its square ([R, H, D] each) before the sum; here they stay in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 16


@triton.jit
def _row_sq_dist_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    num_rows,
    num_heads,
    stride_a_tok,
    stride_a_head,
    stride_a_dim,
    stride_b_tok,
    stride_b_head,
    stride_b_dim,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program: BLOCK_R rows, every head. reads 2*BLOCK_R*H*D, writes BLOCK_R.
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_mask = rows < num_rows
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
    a_row = a_ptr + rows[:, None].to(tl.int64) * stride_a_tok + dims[None, :] * stride_a_dim  # [BLOCK_R, BLOCK_D]
    b_row = b_ptr + rows[:, None].to(tl.int64) * stride_b_tok + dims[None, :] * stride_b_dim
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for head in range(num_heads):
        a = tl.load(a_row + head * stride_a_head, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_row + head * stride_b_head, mask=mask, other=0.0).to(tl.float32)
        diff = a - b
        acc += diff * diff
    tl.store(out_ptr + rows, tl.sum(acc, axis=1), mask=row_mask)


def row_sq_dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sum over heads and head_dim of (a - b)^2 per row, in fp32; same contract as
    cachefuse.deviation.row_sq_dist.

    Args:
        a: `[num_rows, num_heads, head_dim]`, fp32 / fp16 / bf16, any strides.
        b: the same shape on the same device, fp32 / fp16 / bf16 (may differ from a's dtype).

    Returns:
        fp32 `[num_rows]`.
    """
    if a.dim() != 3 or a.shape != b.shape:
        raise ValueError(f"expected a and b [num_rows, num_heads, head_dim], got {tuple(a.shape)} and {tuple(b.shape)}")
    for name, x in (("a", a), ("b", b)):
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"expected fp32/fp16/bf16 {name}, got {x.dtype}")
    if a.device != b.device:
        raise ValueError(f"a on {a.device}, b on {b.device}")
    num_rows, num_heads, head_dim = a.shape
    out = torch.zeros(num_rows, dtype=torch.float32, device=a.device)
    if num_rows == 0 or num_heads == 0 or head_dim == 0:
        return out
    grid = (triton.cdiv(num_rows, BLOCK_R),)
    _row_sq_dist_kernel[grid](
        a, b, out,
        num_rows, num_heads,
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_R=BLOCK_R,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out

"""RoPE apply as a Triton kernel; its torch twin and specification is cachefuse.rope.apply_rope.

Imports torch and triton only (the spec is duck-typed: head_dim, rotary_dim, is_neox_style,
inv_freq, attention_scaling). Nothing runs at import time. CPU tensors need TRITON_INTERPRET=1 set
before this module is imported (triton.jit reads it when decorating).

Traffic: reads N*H*D elements of k_nope (plus N positions and R/2 frequencies), writes N*H*D.
cos/sin are computed in registers from `position * inv_freq`, the same fp32 product as the twin,
so there is no cos/sin cache to read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

if TYPE_CHECKING:
    from cachefuse.rope import RopeSpec

BLOCK_N = 32


@triton.jit
def _apply_rope_kernel(
    k_ptr,
    out_ptr,
    pos_ptr,
    inv_freq_ptr,
    num_tokens,
    stride_k_tok,
    stride_k_head,
    stride_out_tok,
    stride_out_head,
    scaling,
    ROTARY_DIM: tl.constexpr,
    PASS_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    # One program: BLOCK_N tokens of one head. reads BLOCK_N*D, writes BLOCK_N*D.
    pid_n = tl.program_id(0)
    head = tl.program_id(1)
    toks = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    tok_mask = toks < num_tokens
    half = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    half_mask = half < ROTARY_DIM // 2

    pos = tl.load(pos_ptr + toks, mask=tok_mask, other=0).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + half, mask=half_mask, other=0.0)
    angle = pos[:, None] * inv_freq[None, :]  # [BLOCK_N, BLOCK_HALF]
    if USE_LIBDEVICE:
        # Full-range reduction: positions reach 1e5 rad, where approximate sin/cos drift.
        cos = libdevice.cos(angle) * scaling
        sin = libdevice.sin(angle) * scaling
    else:
        cos = tl.cos(angle) * scaling
        sin = tl.sin(angle) * scaling

    if IS_NEOX:
        dim1 = half
        dim2 = half + ROTARY_DIM // 2
    else:
        dim1 = 2 * half
        dim2 = 2 * half + 1
    mask = tok_mask[:, None] & half_mask[None, :]
    k_row = k_ptr + toks[:, None] * stride_k_tok + head * stride_k_head  # [BLOCK_N, 1]
    out_row = out_ptr + toks[:, None] * stride_out_tok + head * stride_out_head
    x1 = tl.load(k_row + dim1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(k_row + dim2[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    tl.store(out_row + dim1[None, :], o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_row + dim2[None, :], o2.to(out_ptr.dtype.element_ty), mask=mask)

    if PASS_DIM > 0:
        # Partial rotary: the tail of each head is copied unchanged.
        dims = ROTARY_DIM + tl.arange(0, BLOCK_PASS)  # [BLOCK_PASS]
        pass_mask = tok_mask[:, None] & (dims < ROTARY_DIM + PASS_DIM)[None, :]
        x = tl.load(k_row + dims[None, :], mask=pass_mask, other=0.0)
        tl.store(out_row + dims[None, :], x, mask=pass_mask)


def apply_rope(k_nope: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotates RoPE-free keys to their absolute positions; same contract as cachefuse.rope.apply_rope.

    Args:
        k_nope: `[num_tokens, num_heads, head_dim]`, fp32 / fp16 / bf16, last dim contiguous;
            not modified.
        positions: int64 `[num_tokens]` on k_nope's device, may be negative.
        spec: the geometry (cachefuse.rope.RopeSpec).

    Returns:
        k: a new contiguous `[num_tokens, num_heads, head_dim]` tensor of k_nope's dtype.
    """
    if k_nope.dim() != 3 or k_nope.shape[-1] != spec.head_dim:
        raise ValueError(f"expected k_nope [num_tokens, num_heads, {spec.head_dim}], got {tuple(k_nope.shape)}")
    if k_nope.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"expected fp32/fp16/bf16 k_nope, got {k_nope.dtype}")
    if k_nope.stride(-1) != 1:
        raise ValueError(f"expected k_nope with a contiguous last dim, got strides {k_nope.stride()}")
    num_tokens, num_heads, _ = k_nope.shape
    if positions.dtype != torch.int64 or tuple(positions.shape) != (num_tokens,):
        raise ValueError(
            f"expected int64 positions [{num_tokens}], got {positions.dtype} {tuple(positions.shape)}"
        )
    if positions.device != k_nope.device:
        raise ValueError(f"positions on {positions.device}, k_nope on {k_nope.device}")
    positions = positions.contiguous()
    inv_freq = spec.inv_freq.to(device=k_nope.device, dtype=torch.float32).contiguous()
    out = torch.empty(k_nope.shape, dtype=k_nope.dtype, device=k_nope.device)
    if num_tokens == 0 or num_heads == 0:
        return out
    pass_dim = spec.head_dim - spec.rotary_dim
    grid = (triton.cdiv(num_tokens, BLOCK_N), num_heads)
    _apply_rope_kernel[grid](
        k_nope, out, positions, inv_freq,
        num_tokens,
        k_nope.stride(0), k_nope.stride(1), out.stride(0), out.stride(1),
        float(spec.attention_scaling),
        ROTARY_DIM=spec.rotary_dim,
        PASS_DIM=pass_dim,
        IS_NEOX=bool(spec.is_neox_style),
        USE_LIBDEVICE=not _interpreted(),
        BLOCK_N=BLOCK_N,
        BLOCK_HALF=triton.next_power_of_2(spec.rotary_dim // 2),
        BLOCK_PASS=triton.next_power_of_2(max(pass_dim, 1)),
    )
    return out


def _interpreted() -> bool:
    """True when triton.jit produced an interpreter function (TRITON_INTERPRET=1), where libdevice is absent."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_apply_rope_kernel, InterpretedFunction)

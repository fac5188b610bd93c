"""Gather + RoPE of loaded chunk keys into a destination buffer, as one Triton kernel; its torch twin
and specification is cachefuse.rope.gather_rotate.

Imports torch and triton only (the spec is duck-typed: head_dim, rotary_dim, is_neox_style,
inv_freq, attention_scaling). Nothing runs at import time. CPU tensors need TRITON_INTERPRET=1 set
before this module is imported (triton.jit reads it when decorating).

`dst[dst_rows[i]] = rotate(src[i])`: src row i is rotated at `dst_positions[i]` (RoPE-free keys) or,
with `src_positions`, turned back from `src_positions[i]` and on to `dst_positions[i]` (keys stored
rotated). Both turns run in fp32 registers and the result is rounded once, to dst's dtype.

Traffic: reads M*H*D elements of src (plus M rows, M or 2M positions and R/2 frequencies), writes
M*H*D elements of dst; the unfused path (apply_rope, then an index_copy) reads and writes the rotated
copy once more. cos/sin are computed in registers from `position * inv_freq`, the same fp32 product
as the twin, so there is no cos/sin cache to read.
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
def _cos_sin(pos, inv_freq, USE_LIBDEVICE: tl.constexpr):
    angle = pos[:, None] * inv_freq[None, :]  # [BLOCK_N, BLOCK_HALF]
    if USE_LIBDEVICE:
        # Full-range reduction: positions reach 1e5 rad, where approximate sin/cos drift.
        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
    else:
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    return cos, sin


@triton.jit
def _gather_rotate_kernel(
    src_ptr,
    dst_ptr,
    rows_ptr,
    dst_pos_ptr,
    src_pos_ptr,
    inv_freq_ptr,
    num_tokens,
    num_dst_rows,
    stride_src_tok,
    stride_src_head,
    stride_dst_tok,
    stride_dst_head,
    scaling,
    ROTARY_DIM: tl.constexpr,
    PASS_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_SRC_POS: tl.constexpr,
    IDENTITY_ROWS: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    # One program: BLOCK_N source rows of one head. reads BLOCK_N*D, writes BLOCK_N*D.
    pid_n = tl.program_id(0)
    head = tl.program_id(1)
    toks = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    tok_mask = toks < num_tokens
    half = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    half_mask = half < ROTARY_DIM // 2

    if IDENTITY_ROWS:  # source row i into row i (apply_rope): no row map to read
        rows = toks.to(tl.int64)
    else:
        rows = tl.load(rows_ptr + toks, mask=tok_mask, other=0)  # [BLOCK_N] int64
    # NOTE: a row outside [0, num_dst_rows) is not written (the twin raises); checking would sync.
    row_mask = tok_mask & (rows >= 0) & (rows < num_dst_rows)
    inv_freq = tl.load(inv_freq_ptr + half, mask=half_mask, other=0.0)
    dst_pos = tl.load(dst_pos_ptr + toks, mask=tok_mask, other=0).to(tl.float32)
    cos, sin = _cos_sin(dst_pos, inv_freq, USE_LIBDEVICE)
    cos = cos * scaling
    sin = sin * scaling

    if IS_NEOX:
        dim1 = half
        dim2 = half + ROTARY_DIM // 2
    else:
        dim1 = 2 * half
        dim2 = 2 * half + 1
    load_mask = tok_mask[:, None] & half_mask[None, :]
    store_mask = row_mask[:, None] & half_mask[None, :]
    # int64: token x stride passes 2**31 elements on long prompts (a q view of Llama-3-8B from 349,526 tokens)
    src_row = src_ptr + toks[:, None].to(tl.int64) * stride_src_tok + head * stride_src_head  # [BLOCK_N, 1]
    dst_row = dst_ptr + rows[:, None] * stride_dst_tok + head * stride_dst_head
    x1 = tl.load(src_row + dim1[None, :], mask=load_mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_row + dim2[None, :], mask=load_mask, other=0.0).to(tl.float32)
    if HAS_SRC_POS:
        # Strip first, as cachefuse.rope.strip_rope does: R(-a) / scaling, kept in fp32.
        src_pos = tl.load(src_pos_ptr + toks, mask=tok_mask, other=0).to(tl.float32)
        cos_s, sin_s = _cos_sin(src_pos, inv_freq, USE_LIBDEVICE)
        cos_s = cos_s / scaling
        sin_s = -sin_s / scaling
        y1 = x1 * cos_s - x2 * sin_s
        y2 = x2 * cos_s + x1 * sin_s
        x1 = y1
        x2 = y2
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    tl.store(dst_row + dim1[None, :], o1.to(dst_ptr.dtype.element_ty), mask=store_mask)
    tl.store(dst_row + dim2[None, :], o2.to(dst_ptr.dtype.element_ty), mask=store_mask)

    if PASS_DIM > 0:
        # Partial rotary: the tail of each head is copied unchanged.
        dims = ROTARY_DIM + tl.arange(0, BLOCK_PASS)  # [BLOCK_PASS]
        dims_mask = (dims < ROTARY_DIM + PASS_DIM)[None, :]
        x = tl.load(src_row + dims[None, :], mask=tok_mask[:, None] & dims_mask, other=0.0)
        tl.store(dst_row + dims[None, :], x.to(dst_ptr.dtype.element_ty), mask=row_mask[:, None] & dims_mask)


def gather_rotate(src: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor, dst_positions: torch.Tensor,
                  spec: RopeSpec, src_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Writes `src` rotated at `dst_positions` into rows `dst_rows` of `dst`; same contract as
    cachefuse.rope.gather_rotate.

    Args:
        src: `[num_tokens, num_heads, head_dim]` keys, fp32 / fp16 / bf16, last dim contiguous;
            RoPE-free, or rotated at `src_positions`. Not modified.
        dst: `[num_dst_rows, num_heads, head_dim]`, fp32 / fp16 / bf16, last dim contiguous (any
            token and head stride); written in place at `dst_rows` only.
        dst_rows: int64 `[num_tokens]`, distinct, in [0, num_dst_rows).
        dst_positions: int64 `[num_tokens]`, the positions to rotate row i to; may be negative.
        spec: the geometry (cachefuse.rope.RopeSpec).
        src_positions: None, or int64 `[num_tokens]`: the positions `src` is rotated at.

    Returns:
        dst.
    """
    _check_args(src, dst, dst_rows, dst_positions, spec, src_positions)
    _launch(src, dst, dst_rows.contiguous(), dst_positions, spec, src_positions)
    return dst


def rotate_into(src: torch.Tensor, dst: torch.Tensor, dst_positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """`gather_rotate` with the identity row map (row i of RoPE-free `src` into row i of `dst`, which
    has src's shape), without building or reading a row tensor: cachefuse.rope.apply_rope's launch."""
    if dst.shape != src.shape:
        raise ValueError(f"expected dst of src's shape {tuple(src.shape)}, got {tuple(dst.shape)}")
    _check_args(src, dst, None, dst_positions, spec, None)
    _launch(src, dst, None, dst_positions, spec, None)
    return dst


def _launch(src, dst, dst_rows, dst_positions, spec, src_positions) -> None:
    """The kernel over checked arguments; `dst_rows` None: row i of src into row i of dst."""
    num_tokens, num_heads, _ = src.shape
    if num_tokens == 0 or num_heads == 0:
        return
    has_src_positions = src_positions is not None
    dst_positions = dst_positions.contiguous()
    # Without src_positions the kernel never reads its pointer: any int64 tensor stands in.
    src_positions = src_positions.contiguous() if has_src_positions else dst_positions
    inv_freq = spec.inv_freq.to(device=src.device, dtype=torch.float32).contiguous()
    pass_dim = spec.head_dim - spec.rotary_dim
    grid = (triton.cdiv(num_tokens, BLOCK_N), num_heads)
    _gather_rotate_kernel[grid](
        src, dst, dst_rows, dst_positions, src_positions, inv_freq,
        num_tokens, dst.shape[0],
        src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        float(spec.attention_scaling),
        ROTARY_DIM=spec.rotary_dim,
        PASS_DIM=pass_dim,
        IS_NEOX=bool(spec.is_neox_style),
        HAS_SRC_POS=has_src_positions,
        IDENTITY_ROWS=dst_rows is None,
        USE_LIBDEVICE=not _interpreted(),
        BLOCK_N=BLOCK_N,
        BLOCK_HALF=triton.next_power_of_2(spec.rotary_dim // 2),
        BLOCK_PASS=triton.next_power_of_2(max(pass_dim, 1)),
    )


def _check_args(src: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor, dst_positions: torch.Tensor,
                spec: RopeSpec, src_positions: torch.Tensor | None) -> None:
    for name, x in (("src", src), ("dst", dst)):
        if x.dim() != 3 or x.shape[-1] != spec.head_dim:
            raise ValueError(f"expected {name} [num_rows, num_heads, {spec.head_dim}], got {tuple(x.shape)}")
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"expected fp32/fp16/bf16 {name}, got {x.dtype}")
        if x.stride(-1) != 1:
            raise ValueError(f"expected {name} with a contiguous last dim, got strides {x.stride()}")
        if x.device != src.device:
            raise ValueError(f"{name} on {x.device}, src on {src.device}")
    if dst.shape[1] != src.shape[1]:
        raise ValueError(f"src has {src.shape[1]} heads, dst {dst.shape[1]}")
    num_tokens = src.shape[0]
    named = (("dst_rows", dst_rows), ("dst_positions", dst_positions), ("src_positions", src_positions))
    for name, x in named:
        if x is None:
            continue
        if x.dtype != torch.int64 or tuple(x.shape) != (num_tokens,):
            raise ValueError(f"expected int64 {name} [{num_tokens}], got {x.dtype} {tuple(x.shape)}")
        if x.device != src.device:
            raise ValueError(f"{name} on {x.device}, src on {src.device}")


def _interpreted() -> bool:
    """True when triton.jit produced an interpreter function (TRITON_INTERPRET=1), where libdevice is absent."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_gather_rotate_kernel, InterpretedFunction)

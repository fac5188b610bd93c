"""The one dispatch point between Triton kernels and their torch twins.

The only module that imports csrc_triton, and only lazily, on the first CUDA call: importing
cachefuse.ops touches no device and does not import triton. CUDA tensors go to the kernel when
triton is importable; everything else (CPU, or no triton) runs the pure-torch twin. Both paths have
the same signature and semantics (tests/csrc_triton prove it).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from cachefuse import attention, deviation, rope
from cachefuse.rope import RopeSpec


@functools.cache
def _triton_rope() -> ModuleType | None:
    """csrc_triton.rope, or None when triton is not installed."""
    try:
        from csrc_triton import rope as tri_rope
    except ImportError:
        return None
    return tri_rope


def apply_rope(k_nope: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotates RoPE-free keys to `positions` (see cachefuse.rope.apply_rope for shapes)."""
    if k_nope.is_cuda:
        tri_rope = _triton_rope()
        if tri_rope is not None:
            return tri_rope.apply_rope(k_nope, positions, spec)
    return rope.apply_rope(k_nope, positions, spec)


def strip_rope(k: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Turns keys back from `positions` (torch twin on every device; see cachefuse.rope.strip_rope)."""
    # NOTE: no kernel yet; strip runs once per saved chunk, off the request's critical path.
    return rope.strip_rope(k, positions, spec)


def shift_rope(k: torch.Tensor, offsets: torch.Tensor | int, spec: RopeSpec) -> torch.Tensor:
    """Turns keys by `offsets` positions (torch twin on every device; see cachefuse.rope.shift_rope)."""
    return rope.shift_rope(k, offsets, spec)


# --------------------------------------------------------------------------- gather_rotate, row_sq_dist


@functools.cache
def _triton_gather_rotate() -> ModuleType | None:
    """csrc_triton.gather_rotate, or None when triton is not installed."""
    try:
        from csrc_triton import gather_rotate as tri_gather_rotate
    except ImportError:
        return None
    return tri_gather_rotate


@functools.cache
def _triton_kv_deviation() -> ModuleType | None:
    """csrc_triton.kv_deviation, or None when triton is not installed."""
    try:
        from csrc_triton import kv_deviation as tri_kv_deviation
    except ImportError:
        return None
    return tri_kv_deviation


def gather_rotate(src: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor, dst_positions: torch.Tensor,
                  spec: RopeSpec, src_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Writes `src` rotated at `dst_positions` into rows `dst_rows` of `dst`, in place; returns dst
    (see cachefuse.rope.gather_rotate for shapes)."""
    if dst.is_cuda:
        tri_gather_rotate = _triton_gather_rotate()
        if tri_gather_rotate is not None:
            return tri_gather_rotate.gather_rotate(src, dst, dst_rows, dst_positions, spec, src_positions)
    return rope.gather_rotate(src, dst, dst_rows, dst_positions, spec, src_positions)


def row_sq_dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 `[num_rows]`: sum over heads and head_dim of (a - b)^2 (see cachefuse.deviation)."""
    if a.is_cuda:
        tri_kv_deviation = _triton_kv_deviation()
        if tri_kv_deviation is not None:
            return tri_kv_deviation.row_sq_dist(a, b)
    return deviation.row_sq_dist(a, b)


# --------------------------------------------------------------------------- rows_attention


@functools.cache
def _triton_sparse_attention() -> ModuleType | None:
    """csrc_triton.sparse_attention, or None when triton is not installed."""
    try:
        from csrc_triton import sparse_attention as tri_sparse_attention
    except ImportError:
        return None
    return tri_sparse_attention


def rows_attention(q: torch.Tensor, q_positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float, block_rows: int = 64, window: int | None = None) -> torch.Tensor:
    """Selected query rows over a full-length K/V, exact per-query causal mask within the layer's sliding
    `window` (see cachefuse.attention.rows_attention for shapes). `block_rows` sizes the twin's SDPA calls;
    the kernel picks its own tiles."""
    if q.is_cuda:
        tri_sparse_attention = _triton_sparse_attention()
        if tri_sparse_attention is not None:
            return tri_sparse_attention.rows_attention(q, q_positions, k, v, scale, window)
    return attention.rows_attention(q, q_positions, k, v, scale, block_rows, window)


def varlen_rows_attention(q: torch.Tensor, q_positions: torch.Tensor, cu_rows: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, cu_keys: torch.Tensor, scale: float,
                          block_rows: int = 64, window: int | None = None) -> torch.Tensor:
    """`rows_attention` for several packed requests in one launch
    (see cachefuse.attention.varlen_rows_attention for shapes)."""
    if q.is_cuda:
        tri_sparse_attention = _triton_sparse_attention()
        if tri_sparse_attention is not None:
            return tri_sparse_attention.varlen_rows_attention(q, q_positions, cu_rows, k, v, cu_keys, scale, window)
    return attention.varlen_rows_attention(q, q_positions, cu_rows, k, v, cu_keys, scale, block_rows, window)


def slot_rows_attention(q: torch.Tensor, q_positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        key_slots: torch.Tensor, scale: float, block_rows: int = 64,
                        window: int | None = None) -> torch.Tensor:
    """`rows_attention` with each key read from a paged cache through its slot
    (see cachefuse.attention.slot_rows_attention for shapes)."""
    if q.is_cuda:
        tri_sparse_attention = _triton_sparse_attention()
        if tri_sparse_attention is not None:
            return tri_sparse_attention.slot_rows_attention(q, q_positions, k_cache, v_cache, key_slots, scale,
                                                            window)
    return attention.slot_rows_attention(q, q_positions, k_cache, v_cache, key_slots, scale, block_rows, window)

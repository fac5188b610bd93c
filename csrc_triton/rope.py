"""RoPE apply on the GPU; its torch twin and specification is cachefuse.rope.apply_rope.

Imports torch and csrc_triton.gather_rotate only (the spec is duck-typed: head_dim, rotary_dim,
is_neox_style, inv_freq, attention_scaling). Nothing runs at import time. CPU tensors need
TRITON_INTERPRET=1 set before this module is imported (triton.jit reads it when decorating).

Applying RoPE is gathering with the identity row map: the launch is gather_rotate's kernel writing
row i of a fresh tensor, so one kernel owns the rotation (cos/sin from `position * inv_freq` in fp32
registers, the twin's product, no cos/sin cache). Traffic: reads N*H*D elements of k_nope (plus N row
indices, N positions and R/2 frequencies), writes N*H*D.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from csrc_triton.gather_rotate import gather_rotate

if TYPE_CHECKING:
    from cachefuse.rope import RopeSpec


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
    num_tokens = k_nope.shape[0]
    if positions.dtype != torch.int64 or tuple(positions.shape) != (num_tokens,):
        raise ValueError(
            f"expected int64 positions [{num_tokens}], got {positions.dtype} {tuple(positions.shape)}"
        )
    if positions.device != k_nope.device:
        raise ValueError(f"positions on {positions.device}, k_nope on {k_nope.device}")
    out = torch.empty(k_nope.shape, dtype=k_nope.dtype, device=k_nope.device)
    rows = torch.arange(num_tokens, dtype=torch.int64, device=k_nope.device)
    return gather_rotate(k_nope, out, rows, positions, spec)

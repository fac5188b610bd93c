"""RoPE apply on the GPU; its torch twin and specification is cachefuse.rope.apply_rope.

Imports torch and csrc_triton.gather_rotate only (the spec is duck-typed: head_dim, rotary_dim,
is_neox_style, inv_freq, attention_scaling). Nothing runs at import time. CPU tensors need
TRITON_INTERPRET=1 set before this module is imported (triton.jit reads it when decorating).

Applying RoPE is gathering with the identity row map: the launch is gather_rotate's kernel writing
row i of a fresh tensor (`rotate_into`: no row tensor is built or read), so one kernel owns the
rotation (cos/sin from `position * inv_freq` in fp32 registers, the twin's product, no cos/sin cache).
Traffic: reads N*H*D elements of k_nope (plus N positions and R/2 frequencies), writes N*H*D.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from csrc_triton.gather_rotate import rotate_into

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
    # rotate_into checks the arguments (shape, dtypes, last-dim contiguity, int64 positions, devices).
    out = torch.empty(k_nope.shape, dtype=k_nope.dtype, device=k_nope.device)
    return rotate_into(k_nope, out, positions, spec)

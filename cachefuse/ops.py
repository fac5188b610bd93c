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

from cachefuse import rope
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

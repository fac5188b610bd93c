"""Per-row K/V deviation in pure torch: the specification for csrc_triton/kv_deviation.py.

Imports only torch; beside rope.py and attention.py, the twins cachefuse.ops dispatches to. CacheBlend's
deviation (cachefuse.select.cacheblend.kv_deviation) is this reduction of one fresh/loaded pair.
"""

import torch


def row_sq_dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Squared L2 distance of each row of `a` and `b`, summed over heads and head_dim, in fp32.

    Args:
        a: `[num_rows, num_heads, head_dim]`, any float dtype.
        b: the same shape, any float dtype.

    Returns:
        fp32 `[num_rows]`.
    """
    return (a.float() - b.float()).pow(2).sum(dim=(1, 2))  # [num_rows]

"""A selection context over fixed segments, and check-layer K/V, for selector unit tests (tests/select/).

SEGMENTS: a 110-token prompt with a 10-token system chunk, chunks of 37 and 50 tokens (87 candidate
rows) and a 13-token question.
"""

import torch

from cachefuse.chunks import Segment
from cachefuse.select.base import CheckLayerKV, SelectionContext

SEGMENTS = (
    Segment(0, 10, is_chunk=True, is_system=True),
    Segment(10, 37, is_chunk=True, is_system=False),
    Segment(47, 50, is_chunk=True, is_system=False),
    Segment(97, 13, is_chunk=False, is_system=False),
)


def make_ctx(ratio: float) -> SelectionContext:
    candidates = [s for s in SEGMENTS if s.is_chunk and not s.is_system]
    rows = torch.cat([torch.arange(s.start, s.end) for s in candidates])
    return SelectionContext(num_tokens=110, num_layers=8, segments=SEGMENTS, candidate_rows=rows,
                            candidate_segments=tuple(candidates), ratio=ratio)


def check_kv(rows: torch.Tensor, seed: int) -> CheckLayerKV:
    g = torch.Generator().manual_seed(seed)
    shape = (rows.numel(), 2, 4)
    return CheckLayerKV(rows, torch.randn(shape, generator=g), torch.randn(shape, generator=g),
                        torch.randn(shape, generator=g), torch.randn(shape, generator=g))

"""LoadedLayers.rotated: the fused gather + rotate (ops.gather_rotate) equals the loader thread's
rotate-then-scatter, bit for bit, on whole entries."""

import torch

from cachefuse import rope
from cachefuse.adapters.base import ModelShape
from cachefuse.chunks import Segment
from cachefuse.fusion.layers import LoadedLayers
from cachefuse.fusion.plan import FuseRequest
from cachefuse.rope import RopeSpec
from cachefuse.store.base import ChunkKV


def test_rotated_before_and_after_the_first_merged_layer_agree():
    shape = ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
                       vocab_size=10, scaling=0.25, dtype=torch.bfloat16)
    spec = RopeSpec(16, 16, True, 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)))
    segments = [Segment(0, 3, False, False), Segment(3, 5, True, False), Segment(8, 2, False, False),
                Segment(10, 4, True, False)]
    entries = {}
    for index in (1, 3):
        k_nope = torch.randn(segments[index].length, 2, 16).to(torch.bfloat16)
        v = torch.randn(segments[index].length, 2, 16).to(torch.bfloat16)
        entries[index] = ChunkKV([k_nope, k_nope], [v, v])  # the same K/V at both layers
    request = FuseRequest(torch.zeros(14, dtype=torch.int64), segments, entries, ratio=0.5)
    rows = torch.cat([torch.arange(3, 8), torch.arange(10, 14)])
    # first_merged_layer=1: layer 0 has no rotated copy (fused path), layer 1 has one (scatter path).
    with LoadedLayers(request, 14, shape, spec, first_merged_layer=1, check_layers={0}) as loaded:
        loaded.advance(0)
        k0, v0 = loaded.rotated(0)
        loaded.advance(1)
        k1, v1 = loaded.rotated(1)
    assert torch.equal(k0[rows], k1[rows]) and torch.equal(v0[rows], v1[rows])
    k_nope = torch.cat([entries[1].k_nope[0], entries[3].k_nope[0]])
    assert torch.equal(k0[rows], rope.apply_rope(k_nope, rows, spec))
    assert not torch.equal(k0[rows], rope.apply_rope(k_nope, rows + 1, spec))  # negative control

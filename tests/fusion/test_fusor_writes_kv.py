"""An attention backend that writes each layer's K/V (`writes_kv`) leaves the pass holding only the holes'.

Inside vLLM the worker's backend writes every layer's merged K/V into the request's paged slots as it
attends (cachefuse.vllm.paged), so the pass must not keep each layer's whole prompt to the end (1 GiB per
8K tokens on Llama-3-8B, outside vLLM's memory profile). Here a backend writes into a cache of its own
(a dict, as the slots would be) and attends with the fusor's own torch functions: the pass's logits, the
written K/V and the saved hole must equal a pass without it, bit for bit, and the result must hold no
layer's K/V but the holes'. Negative control: a backend without `writes_kv` keeps every layer.
"""

from __future__ import annotations

import pytest
import torch

from cachefuse import ops
from cachefuse.attention import causal_attention
from tests.helpers.fusion import make_case, make_engine, precompute_case


class RecordingCache:
    """Each layer's merged K/V as the backend would write it into the slots, then the fusor's attention."""

    def __init__(self, scale: float, writes_kv: bool) -> None:
        self.scale, self.writes_kv, self.written = scale, writes_kv, {}

    def causal(self, layer, q, k, v):
        self.written[layer] = (k.clone(), v.clone())
        return causal_attention(q, k, v, self.scale)

    def rows(self, layer, q, q_positions, k, v):
        self.written[layer] = (k.clone(), v.clone())
        return ops.rows_attention(q, q_positions, k, v, self.scale, 64)


def _run(adapter, backend, selector="cacheblend"):
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=3)
    precompute_case(engine, case)  # chunk B stays a hole
    result, stats = engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.15, save_holes=True,
                                   save_inline=True, attention_backend=backend)
    return engine, case, result, stats


@pytest.mark.parametrize("selector", ["cacheblend", "epic", "full_prefill"])
def test_backend_that_writes_keeps_only_the_holes(adapter, selector):
    plain_engine, case, plain, plain_stats = _run(adapter, None, selector)
    backend = RecordingCache(adapter.shape.scaling, writes_kv=True)
    engine, _, written, stats = _run(adapter, backend, selector)
    assert written.k == [] and written.v == []  # nothing of any layer outlives the pass but the holes
    assert torch.equal(written.logits, plain.logits)
    num_layers = adapter.shape.num_layers
    for layer in range(num_layers):  # what reached the cache is the pass's merged K/V
        assert torch.equal(backend.written[layer][0], plain.k[layer])
        assert torch.equal(backend.written[layer][1], plain.v[layer])
    holes = [case.chunks[index] for index in written.hole_segments]
    assert holes and sorted(written.hole_kv) == [start for start, _ in holes]
    for start, end in holes:
        assert all(k.shape[0] == end - start for k in written.hole_kv[start][0] + written.hole_kv[start][1])
    assert stats.saved_keys == plain_stats.saved_keys and stats.holes_saved == len(holes)
    for key in stats.saved_keys:  # the saved holes, from hole_kv, equal those saved from the whole K/V
        stored, expected = engine.store.get(key), plain_engine.store.get(key)
        assert all(torch.equal(a, b) for a, b in zip(stored.k_nope + stored.v, expected.k_nope + expected.v,
                                                     strict=True))


def test_negative_control_backend_without_writes_keeps_every_layer(adapter):
    backend = RecordingCache(adapter.shape.scaling, writes_kv=False)
    _, _, result, _ = _run(adapter, backend)
    assert len(result.k) == adapter.shape.num_layers and result.hole_kv == {}

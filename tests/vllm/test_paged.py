"""PagedAttention (vLLM's own CPU kernel) against its torch twin, cachefuse.attention.

Exact per query: full causal layers as one sequence, selected rows as one single-token sequence
each. Negative control: the same rows as one multi-row sequence (the kernel's end-aligned causal
mask) let scattered rows see later keys, and the comparison catches it.
"""

from __future__ import annotations

import pytest
import torch

from cachefuse.attention import causal_attention, rows_attention
from cachefuse.vllm.cache_views import paged_kv_views
from cachefuse.vllm.paged import (
    PagedAttention,
    SlotWritingAttention,
    paged_forward,
    supports_paged_attention,
    write_layer_kv,
)
from tests.helpers.vllm_engines import start_engine, stop_engine, worker_side


@pytest.fixture(scope="module")
def family():
    return "qwen3"


@pytest.fixture(scope="module")
def paged(tiny_model_dir, tmp_path_factory):
    llm = start_engine(tiny_model_dir("qwen3"), tmp_path_factory.mktemp("paged-store"))
    layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    names = worker_side().layer_names
    assert all(supports_paged_attention(layers[name]) for name in names)
    num_tokens, block_size = 301, llm.llm_engine.vllm_config.cache_config.block_size
    blocks = list(range(1, num_tokens // block_size + 2))  # idle engine: these blocks hold nothing live
    slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(num_tokens)])
    yield PagedAttention(layers, names, slots, torch.tensor([blocks], dtype=torch.int32)), layers[names[0]]
    stop_engine(llm)


def make_qkv(layer, num_tokens=301, seed=0):
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim = layer.impl.num_heads, layer.impl.num_kv_heads, layer.impl.head_size
    return (torch.randn(num_tokens, heads, head_dim, generator=g), torch.randn(num_tokens, kv_heads, head_dim, generator=g),
            torch.randn(num_tokens, kv_heads, head_dim, generator=g), layer.impl.scale)


def test_causal_matches_torch_twin(paged):
    backend, layer = paged
    q, k, v, scale = make_qkv(layer)
    with torch.inference_mode():
        expected = causal_attention(q, k, v, scale)
        actual = backend.causal(0, q, k, v)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [[0], [5, 6, 7], [3, 40, 41, 170, 299, 300], list(range(0, 301, 7))])
def test_rows_match_torch_twin(paged, rows):
    backend, layer = paged
    q, k, v, scale = make_qkv(layer, seed=len(rows))
    positions = torch.tensor(rows)
    with torch.inference_mode():
        expected = rows_attention(q[positions], positions, k, v, scale)
        actual = backend.rows(1, q[positions], positions, k, v)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_one_multi_row_sequence_would_leak_future_keys(paged):
    backend, layer = paged
    q, k, v, scale = make_qkv(layer, seed=9)
    positions = torch.tensor([3, 40, 170, 300])  # scattered rows
    with torch.inference_mode():
        exact = rows_attention(q[positions], positions, k, v, scale)
        num_rows = positions.numel()
        write_layer_kv(layer, k, v, backend.slot_mapping)
        leaky = paged_forward(layer, q[positions], k, v, torch.tensor([0, num_rows], dtype=torch.int32),
                               torch.tensor([301], dtype=torch.int32), backend.block_table)
    assert not torch.allclose(leaky, exact, atol=1e-3)  # end-aligned: row 3 would see keys up to 297


def test_cpu_backend_packs_its_keys_so_slot_writing_reads_contiguous(paged):
    """vLLM's CPU backend stores keys in its kernel's own order, so cache_views' probe must refuse to read
    them in place; SlotWritingAttention then attends over the contiguous K/V and still equals the twin."""
    backend, layer = paged
    assert paged_kv_views(layer) is None
    slot_writing = SlotWritingAttention(backend.layers, backend.layer_names, backend.slot_mapping, layer.impl.scale)
    q, k, v, scale = make_qkv(layer, seed=4)
    positions = torch.tensor([3, 40, 170, 300])
    with torch.inference_mode():
        expected = rows_attention(q[positions], positions, k, v, scale)
        actual = slot_writing.rows(1, q[positions], positions, k, v)
    assert slot_writing.read_in_place == {backend.layer_names[1]: False}
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)

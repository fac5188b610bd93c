"""cachefuse.vllm.kv_quant against vLLM's own CPU kernels over an fp8 cache.

- The codes vLLM's reads return for what the layer's writer stored equal the twin's round trip exactly
  (toward zero, saturating); the CUDA rule (nearest even) does not match them (negative control).
- PagedAttention over an fp8 cache written with the layer's scales equals the torch twin over
  `as_read_from_cache` K/V, with scales that are not powers of two; over unrounded K/V, or written
  without the scales, it does not (negative controls). SlotWritingAttention (the GPU path) equals it.
"""

from __future__ import annotations

import pytest
import torch

from cachefuse.attention import causal_attention, rows_attention
from cachefuse.vllm import kv_quant
from cachefuse.vllm.paged import PagedAttention, SlotWritingAttention, paged_forward, write_layer_kv
from tests.helpers.vllm_engines import start_engine, stop_engine

pytestmark = pytest.mark.skipif(not torch.cpu._is_avx512_supported(),
                                reason="vLLM's CPU backend serves fp8 KV caches only on x86 with AVX-512 or AMX")
FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SCALES = (0.3, 1.7)  # k_scale, v_scale: not powers of two, so a write that skips them is seen


@pytest.fixture(scope="module", params=list(FORMATS))
def fp8_layers(request, tiny_model_dir):
    """(format, attention layers by name, layer names) of an idle engine over an fp8 cache."""
    llm = start_engine(tiny_model_dir("llama"), engine_args={"kv_cache_dtype": request.param})
    layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    names = [name for name, layer in layers.items() if hasattr(layer, "impl")]
    yield request.param, layers, names
    stop_engine(llm)


def set_scales(layer, k_scale: float, v_scale: float) -> None:
    """The layer's K/V scales as a checkpoint with calibrated scales would load them."""
    layer._k_scale.fill_(k_scale)
    layer._v_scale.fill_(v_scale)
    layer._k_scale_float, layer._v_scale_float = k_scale, v_scale


@pytest.fixture
def layer0(fp8_layers):
    fmt, layers, names = fp8_layers
    layer = layers[names[0]]
    yield fmt, layer, layers, names
    set_scales(layer, 1.0, 1.0)


def paged_backend(layers, names, layer, num_tokens):
    block_size = layer.kv_cache.shape[2]
    blocks = list(range(1, num_tokens // block_size + 2))  # idle engine: these blocks hold nothing live
    slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(num_tokens)])
    return PagedAttention(layers, names, slots, torch.tensor([blocks], dtype=torch.int32))


def test_codes_read_back_as_the_twin_rounds(layer0):
    """Each value written alone in its own block and read by a one-token sequence: the attention output
    is the stored V itself, dequantized by vLLM's kernel."""
    fmt, layer, _, _ = layer0
    num_seqs, block_size = 512, layer.kv_cache.shape[2]
    g = torch.Generator().manual_seed(1)
    magnitudes = torch.empty(num_seqs, layer.impl.num_kv_heads, layer.impl.head_size).uniform_(-14, 7, generator=g)
    v = magnitudes.exp() * torch.where(torch.rand(magnitudes.shape, generator=g) < 0.5, -1.0, 1.0)
    v[0, 0, :4] = torch.tensor([0.0, 448.0, 500.0, 1e6])  # zero, the e4m3 limit, past it (saturates)
    k = torch.zeros_like(v)
    set_scales(layer, 1.0, 1.0)
    blocks = torch.arange(1, num_seqs + 1)
    with torch.inference_mode():
        write_layer_kv(layer, k, v, blocks * block_size)
        out = paged_forward(layer, torch.randn(num_seqs, layer.impl.num_heads, layer.impl.head_size, generator=g),
                            k, v, torch.arange(num_seqs + 1, dtype=torch.int32),
                            torch.ones(num_seqs, dtype=torch.int32), blocks.to(torch.int32)[:, None])
    group = layer.impl.num_heads // layer.impl.num_kv_heads
    read = out.view(num_seqs, layer.impl.num_heads, -1)[:, ::group]  # one query head per KV head
    assert torch.equal(read, kv_quant.as_read_from_cache(layer, k, v)[1])
    nearest = kv_quant._nearest_even(v, 1.0, FORMATS[fmt])  # negative control: CUDA's rounding
    assert (nearest != read).sum() > v.numel() // 10


def make_qkv(layer, num_tokens, seed):
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim = layer.impl.num_heads, layer.impl.num_kv_heads, layer.impl.head_size
    return (torch.randn(num_tokens, heads, head_dim, generator=g), torch.randn(num_tokens, kv_heads, head_dim, generator=g),
            torch.randn(num_tokens, kv_heads, head_dim, generator=g))


def test_paged_attention_over_fp8_equals_twin_over_rounded_kv(layer0):
    _, layer, layers, names = layer0
    set_scales(layer, *SCALES)
    backend = paged_backend(layers, names, layer, 301)
    q, k, v = make_qkv(layer, 301, seed=2)
    positions = torch.tensor([3, 40, 41, 170, 299, 300])
    with torch.inference_mode():
        k_read, v_read = kv_quant.as_read_from_cache(layer, k, v)
        causal = backend.causal(0, q, k, v)
        torch.testing.assert_close(causal, causal_attention(q, k_read, v_read, layer.impl.scale), atol=1e-5, rtol=1e-5)
        rows = backend.rows(0, q[positions], positions, k, v)
        expected_rows = rows_attention(q[positions], positions, k_read, v_read, layer.impl.scale)
        torch.testing.assert_close(rows, expected_rows, atol=1e-5, rtol=1e-5)
        # negative control: the unrounded K/V are not what the kernel read
        assert not torch.allclose(causal, causal_attention(q, k, v, layer.impl.scale), atol=1e-2)


def test_negative_control_a_write_without_the_scales_is_caught(layer0):
    _, layer, layers, names = layer0
    backend = paged_backend(layers, names, layer, 64)
    q, k, v = make_qkv(layer, 64, seed=3)
    with torch.inference_mode():
        set_scales(layer, 1.0, 1.0)  # written as if the layer had no scales ...
        write_layer_kv(layer, k, v, backend.slot_mapping)
        set_scales(layer, *SCALES)  # ... read with the ones it has
        out = paged_forward(layer, q, k, v, torch.tensor([0, 64], dtype=torch.int32), torch.tensor([64], dtype=torch.int32),
                            backend.block_table)
        expected = causal_attention(q, *kv_quant.as_read_from_cache(layer, k, v), layer.impl.scale)
    assert not torch.allclose(out, expected, atol=1e-2)


def test_slot_writing_attention_over_fp8_equals_paged_kernel(layer0):
    """The generic (GPU) path attends in memory: over the rounded K/V it equals vLLM's paged reads."""
    _, layer, layers, names = layer0
    set_scales(layer, *SCALES)
    backend = paged_backend(layers, names, layer, 301)
    slot_writing = SlotWritingAttention(layers, names, backend.slot_mapping, layer.impl.scale)
    q, k, v = make_qkv(layer, 301, seed=4)
    positions = torch.tensor([0, 7, 64, 65, 200, 300])
    with torch.inference_mode():
        expected = backend.rows(0, q[positions], positions, k, v)
        actual = slot_writing.rows(0, q[positions], positions, k, v)
        causal = slot_writing.causal(0, q, k, v)
        expected_causal = backend.causal(0, q, k, v)
    assert slot_writing.read_in_place == {names[0]: False}  # fp8 codes are never read in place
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(causal, expected_causal, atol=1e-5, rtol=1e-5)


def test_unquantized_formats_pass_through():
    assert kv_quant.fp8_format("auto") is None and kv_quant.fp8_format("bfloat16") is None
    assert kv_quant.fp8_format("fp8") == kv_quant.fp8_format("fp8_e4m3") == torch.float8_e4m3fn
    assert kv_quant.fp8_format("fp8_e5m2") == torch.float8_e5m2

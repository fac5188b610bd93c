"""Quantized (fp8) paged KV caches: what the blend pass hands vLLM's writer, and what vLLM's reads return.

Imports torch; vLLM only inside functions. vLLM's attention layers quantize K/V as they write them
(`impl.do_kv_cache_update`: each value divided by the layer's `_k_scale_float` / `_v_scale_float` and
rounded to fp8) and dequantize as they read (the code times the scale). The blend pass writes through
that same op, handing it K/V in the model's dtype, never cast to the cache's byte dtype first (a
blind cast would store integer truncations, not fp8 codes, and skip the scales). Where the pass attends
over K/V held in memory instead of reading the cache (SlotWritingAttention; PagedAttention's rows past
the slots), it attends over `as_read_from_cache(layer, k, v)`: the K/V vLLM's own reads return, so a
row sees what vLLM's prefill over the same fp8 cache would have seen.

How a value rounds to its code is the backend's: vLLM's CPU kernel (cpu_attn_reshape_and_cache)
rounds toward zero and saturates at the format's largest finite value (measured against the kernel's
own reads: tests/vllm/test_kv_quant.py); vLLM's CUDA writers convert with round-to-nearest-even,
saturating (`__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, ...)`), which is torch's rounding once
clamped.

A stored chunk stays in the model's dtype, RoPE stripped: it is re-rotated to a new position before it
is written, and quantizing then would round it twice (once stored, once written).
"""

from __future__ import annotations

import math
from typing import Any

import torch

QUANTIZED_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
"""vLLM's `--kv-cache-dtype` values the blend pass serves: one fp8 code per value, one scale per layer.
("fp8" is e4m3: vLLM stores the same bytes for "fp8" and "fp8_e4m3".)"""


def fp8_format(kv_cache_dtype: str) -> torch.dtype | None:
    """The torch dtype of one cached code under `kv_cache_dtype`; None for an unquantized cache."""
    if kv_cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        from vllm.platforms import current_platform

        return current_platform.fp8_dtype()  # e4m3fn; e4m3fnuz on the ROCm platforms that use it
    return None


def is_quantized(layer: Any) -> bool:
    """True when `layer` (a vLLM Attention layer) keeps its K/V as fp8 codes."""
    return fp8_format(layer.impl.kv_cache_dtype) is not None


def write_dtype(layer: Any) -> torch.dtype:
    """The dtype of the K/V handed to the layer's writer: the model's for a quantized cache (the writer
    quantizes with the layer's scales), else the cache's own."""
    return layer.dtype if is_quantized(layer) else layer.kv_cache.dtype


def as_read_from_cache(layer: Any, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [T, kv_heads, head_dim] as vLLM's attention reads them back after the layer's writer stored
    them: rounded to the layer's fp8 codes with its scales, as its backend rounds; unchanged for an
    unquantized cache."""
    code_dtype = fp8_format(layer.impl.kv_cache_dtype)
    if code_dtype is None:
        return k, v
    round_trip = _toward_zero if _rounds_toward_zero(layer) else _nearest_even
    return (round_trip(k, layer._k_scale_float, code_dtype),  # reads T*kv_heads*head_dim, writes the same
            round_trip(v, layer._v_scale_float, code_dtype))


def _rounds_toward_zero(layer: Any) -> bool:
    """True for vLLM's CPU attention backend, whose writer truncates to the code."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    except ImportError:  # a vLLM build without the CPU backend
        return False
    return isinstance(layer.impl, CPUAttentionBackendImpl)


def _nearest_even(x: torch.Tensor, scale: float, code_dtype: torch.dtype) -> torch.Tensor:
    """x / scale rounded to the nearest code (saturating), times scale."""
    largest = torch.finfo(code_dtype).max
    return ((x.float() / scale).clamp(-largest, largest).to(code_dtype).float() * scale).to(x.dtype)


def _toward_zero(x: torch.Tensor, scale: float, code_dtype: torch.dtype) -> torch.Tensor:
    """x / scale rounded toward zero to a code (saturating at the largest finite code), times scale."""
    info = torch.finfo(code_dtype)
    mantissa_bits = round(-math.log2(info.eps))  # eps = 2 ** -mantissa_bits: 3 for e4m3, 2 for e5m2
    scaled = (x.float() / scale).clamp(-info.max, info.max)
    magnitude = scaled.abs()
    # a normal code keeps the top `mantissa_bits` of fp32's 23: clear the rest
    normal = (magnitude.view(torch.int32) & ~((1 << (23 - mantissa_bits)) - 1)).view(torch.float32)
    # below the smallest normal, codes are evenly spaced (subnormals): the step is exact in fp32
    step = info.smallest_normal * 2.0 ** -mantissa_bits
    subnormal = torch.floor(magnitude / step) * step
    codes = torch.where(magnitude < info.smallest_normal, subnormal, normal).copysign(scaled)
    return (codes * scale).to(x.dtype)

"""Reading a vLLM attention layer's paged K/V in place: per-page K and V views, proven per backend.

vLLM's per-layer cache tensor is of logical shape [pages, kv_heads, page_size, content]; each backend
decides what `content` holds and in what physical order. Under FlashAttention, FlashInfer and the
Triton backend the content is a token's K then its V (2 * head_dim), and `cache.transpose(1, 2).split(
head_dim, -1)` gives the K and V caches as strided views [pages, page_size, kv_heads, head_dim]
(vLLM's own `do_kv_cache_update` takes them the same way). Other backends pack differently: the CPU
backend lays each page's keys out in an ISA-specific order that only its own kernels read.

So the views are not trusted from the backend's name. The first time a layer of a given backend and
cache layout is read, a probe writes known K/V through that layer's own `impl.do_kv_cache_update`
into a two-page scratch cache with the live cache's dtype, device and stride order (the live cache
is never touched) and reads them back through the views: an exact match proves them; anything else
(a packed layout, a write that raises) leaves the layer to be read from the
contiguous K/V instead. A quantized (fp8) cache is never read in place: it holds codes, which only
dequantizing readers may read. The verdict is kept per (impl type, dtype, device, shape of a page, stride
order), so a model probes once, not once per layer or request.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from cachefuse.vllm import kv_quant

logger = logging.getLogger(__name__)

_verdicts: dict[tuple, bool] = {}
_verdicts_lock = threading.Lock()


def paged_kv_views(layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(k_cache, v_cache), each [pages, page_size, kv_heads, head_dim], viewing `layer.kv_cache` in
    place; None when the layer's backend is not proven to store plain per-token K|V rows."""
    cache = layer.kv_cache
    views = _flash_views(cache, layer.impl.head_size)
    if views is None or kv_quant.is_quantized(layer):  # fp8 codes, not K/V: the reader must dequantize
        return None
    layout = (type(layer.impl), cache.dtype, cache.device, tuple(cache.shape[1:]), _physical_order(cache))
    with _verdicts_lock:
        verdict = _verdicts.get(layout)
        if verdict is None:
            verdict = _verdicts[layout] = _probe(layer)
    return views if verdict else None


def _flash_views(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(B, H, N, 2*D) -> ((B, N, H, D), (B, N, H, D)); None for a tensor of another shape."""
    if cache.dim() != 4 or cache.shape[-1] != 2 * head_dim or cache.stride(-1) != 1:
        return None
    k_cache, v_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
    return k_cache, v_cache


def _physical_order(cache: torch.Tensor) -> tuple[int, ...]:
    """The logical axes from outermost to innermost in memory (size-1 axes last among ties)."""
    return tuple(sorted(range(cache.dim()), key=lambda axis: (-cache.stride(axis), cache.shape[axis] == 1)))


def _scratch_like(cache: torch.Tensor, num_pages: int) -> torch.Tensor:
    """A zeroed cache of `num_pages` pages with `cache`'s dtype, device and physical axis order."""
    order = _physical_order(cache)
    physical = torch.zeros([num_pages if axis == 0 else cache.shape[axis] for axis in order],
                           dtype=cache.dtype, device=cache.device)
    return physical.permute([order.index(axis) for axis in range(cache.dim())])


def _probe(layer: Any) -> bool:
    """Writes two pages of distinct K/V through the layer's own writer into a scratch cache and checks
    that the views read them back exactly."""
    impl, cache = layer.impl, layer.kv_cache
    scratch = _scratch_like(cache, num_pages=2)
    k_cache, v_cache = _flash_views(scratch, impl.head_size)
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_tokens = 2 * page_size
    generator = torch.Generator().manual_seed(0)
    k = torch.randn(num_tokens, num_kv_heads, impl.head_size, generator=generator).to(cache.dtype)
    v = torch.randn(num_tokens, num_kv_heads, impl.head_size, generator=generator).to(cache.dtype)
    slots = torch.randperm(num_tokens, generator=generator)
    pages, offsets = (slots // page_size).to(cache.device), (slots % page_size).to(cache.device)
    try:
        impl.do_kv_cache_update(layer, k.to(cache.device), v.to(cache.device), scratch, slots.to(cache.device))
        proven = (torch.equal(k_cache[pages, offsets].cpu(), k) and torch.equal(v_cache[pages, offsets].cpu(), v))
    except Exception as exc:  # a backend whose writer rejects the probe is read from contiguous K/V
        logger.info("cachefuse: %s's cache is read from contiguous K/V (probe raised %s: %s)",
                    type(impl).__name__, type(exc).__name__, exc)
        return False
    logger.info("cachefuse: %s's paged cache is %s", type(impl).__name__,
                "read in place by the blend pass" if proven else "not plain K|V rows; read from contiguous K/V")
    return proven

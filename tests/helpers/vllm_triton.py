"""vLLM's own Triton attention backend (`TRITON_ATTN`, a GPU backend) run on CPU tensors, interpreted.

vLLM's CPU build turns Triton off (`vllm.triton_utils` hands out placeholders when Triton has no CPU
backend), so its Triton kernels cannot run here as imported. Under TRITON_INTERPRET=1 they can: this
module loads the source files of vLLM's writer (`triton_reshape_and_cache_flash`) and its attention
(`triton_unified_attention`) a second time with the real `triton`, and points `TritonAttentionImpl` at
those copies. Nothing else is changed: the impl class, its `do_kv_cache_update`, its `forward` and both
kernels are vLLM 0.32.0's own code. The one shim is `torch.cuda.get_device_capability`, which the writer
reads to pick a tile size (an H100's answer here).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

import pytest
import torch

KERNEL_SOURCES = {
    "triton_reshape_and_cache_flash": "vllm.v1.attention.ops.triton_reshape_and_cache_flash",
    "unified_attention": "vllm.v1.attention.ops.triton_unified_attention",
}
JIT_HELPERS = ("vllm.v1.attention.ops.triton_attention_helpers",)
"""Modules of @triton.jit functions the kernels call: reloaded first, so the copies import real ones."""


def _with_real_triton(module_name: str) -> ModuleType:
    """A fresh copy of one of vLLM's kernel modules, its `triton` / `tl` the real ones."""
    import triton
    import triton.language as tl
    import vllm.triton_utils as triton_utils

    spec = importlib.util.find_spec(module_name)
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_utils, "triton", triton)
        patch.setattr(triton_utils, "tl", tl)
        spec.loader.exec_module(module)
    return module


def _reloaded_kernels() -> dict[str, object]:
    """The kernels by name, loaded with the real triton, their jit helpers too."""
    with pytest.MonkeyPatch.context() as patch:
        for helper in JIT_HELPERS:
            patch.setitem(sys.modules, helper, _with_real_triton(helper))
        return {name: getattr(_with_real_triton(module), name) for name, module in KERNEL_SOURCES.items()}


def vllm_triton_backend(engines: bool = False) -> Iterator[ModuleType]:
    """Yields `vllm.v1.attention.backends.triton_attn` with real (interpreted) kernels; a skip unless
    TRITON_INTERPRET=1. `engines`: meanwhile, engines started in this process attend with it too (vLLM's
    CPU platform, which otherwise answers every backend choice with its own, takes TRITON_ATTN, and the
    selector's cached choice is dropped on the way in and out)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("vLLM's Triton kernels run on CPU only interpreted (TRITON_INTERPRET=1)")
    pytest.importorskip("triton")
    import vllm.v1.attention.backends.triton_attn as triton_attn

    kernels = _reloaded_kernels()
    with pytest.MonkeyPatch.context() as patch:
        for name, kernel in kernels.items():
            patch.setattr(triton_attn, name, kernel)
        patch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0))
        if not engines:
            yield triton_attn
            return
        from vllm.platforms.cpu import CpuPlatform
        from vllm.v1.attention import selector

        backend_path = f"{triton_attn.__name__}.{triton_attn.TritonAttentionBackend.__name__}"
        patch.setattr(CpuPlatform, "get_attn_backend_cls", classmethod(lambda cls, *args, **kwargs: backend_path))
        selector._cached_get_attn_backend.cache_clear()
        try:
            yield triton_attn
        finally:
            selector._cached_get_attn_backend.cache_clear()


def triton_layer(triton_attn: ModuleType, num_heads: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int = 16, head_major: bool = False, dtype: torch.dtype = torch.float32
                 ) -> SimpleNamespace:
    """An attention layer as vLLM's model runner binds it: `impl` (TritonAttentionImpl), `kv_cache` of
    logical shape [pages, kv_heads, page_size, 2 * head_dim], stored page-token-head (vLLM's default
    NHD) or page-head-token (`head_major`), and the unit K/V scales `forward` reads."""
    impl = triton_attn.TritonAttentionImpl(num_heads, head_dim, 1 / math.sqrt(head_dim), num_kv_heads,
                                           None, None, "auto")
    if head_major:
        cache = torch.zeros(num_pages, num_kv_heads, page_size, 2 * head_dim, dtype=dtype)
    else:
        cache = torch.zeros(num_pages, page_size, num_kv_heads, 2 * head_dim, dtype=dtype).permute(0, 2, 1, 3)
    one = torch.ones((), dtype=torch.float32)
    return SimpleNamespace(impl=impl, kv_cache=cache, _k_scale=one, _v_scale=one, _q_scale=one)


def decode_attention(triton_attn: ModuleType, layer: SimpleNamespace, q: torch.Tensor, num_context: int,
                     block_table: torch.Tensor) -> torch.Tensor:
    """vLLM's own `TritonAttentionImpl.forward` for one new token at position `num_context` of one
    request: `q` [1, heads, head_dim] over the `num_context` keys already in the request's pages plus its
    own, which the caller has written at the next slot. Returns [1, heads, head_dim]."""
    seq_len = num_context + 1
    metadata = triton_attn.TritonAttentionMetadata(
        num_actual_tokens=1, max_query_len=1, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        max_seq_len=seq_len, seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_table=block_table[None].to(torch.int32), slot_mapping=torch.empty(0, dtype=torch.int64),
        seq_threshold_3D=0, num_par_softmax_segments=0, softmax_segm_output=torch.empty(0),
        softmax_segm_max=torch.empty(0), softmax_segm_expsum=torch.empty(0), causal=True)
    out = torch.empty_like(q)
    layer.impl.forward(layer, q, None, None, layer.kv_cache, metadata, out)
    return out

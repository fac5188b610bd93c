"""The blend pass's attention inside vLLM: each layer's merged K/V written into the request's slots.

Each layer's merged K/V (loaded rows re-rotated, recomputed rows fresh) is written into the
request's own blocks (the slots vLLM allocated for this prompt, which the connector must fill
anyway) through the layer's own `impl.do_kv_cache_update`, which knows its backend's paged layout
(`reshape_and_cache_flash` under FlashAttention). The fusor then keeps no layer's K/V past the
layer (FuseResult.hole_kv: only the holes' rows, for saving). Two backends attend:

`SlotWritingAttention`, under any vLLM attention backend (FlashAttention, FlashInfer, Triton on GPUs):
the selected rows attend from the request's blocks, as vLLM's own backends do: each selected row its
own query over the keys at positions <= its own, read in place through the slots just written
(cachefuse.ops.slot_rows_attention: on CUDA the Triton sparse-query kernel, one launch per layer;
elsewhere its torch twin). A backend whose cache is not proven to hold plain K|V rows
(cachefuse.vllm.cache_views: the CPU backend's packed keys) attends over the layer's merged K/V in
memory instead (cachefuse.ops.rows_attention), with the same result.

`PagedAttention`, under vLLM's CPU backend, attends with vLLM's own paged kernel from the cache:

- a layer that computes every row (CacheBlend's layer 0) is one causal prefill sequence;
- selected rows are one single-token sequence each, whose context is exactly the keys at
  positions <= its own. The kernel aligns its causal mask to the end of a sequence, so this is the
  exact per-query mask (a multi-row sequence would let scattered rows see later keys).

On this machine the kernel runs the full causal layer 2.4x and the selected rows 1.3x faster than
torch's SDPA (cachefuse.attention, the reference twin, which the tests compare it against).
Only CacheFuseConnector's worker uses these, between planning and vLLM's forward of the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from cachefuse import ops
from cachefuse.attention import causal_attention
from cachefuse.vllm.cache_views import paged_kv_views


def supports_paged_attention(layer: Any) -> bool:
    """True for vLLM's CPU attention backend (the one PagedAttention drives)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    except ImportError:  # a vLLM build without the CPU backend
        return False
    return isinstance(layer.impl, CPUAttentionBackendImpl) and hasattr(layer, "isa")


def write_layer_kv(layer: Any, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """One layer's K/V [T, kv_heads, head_dim] into the slots of positions 0..T-1, in the cache's dtype."""
    dtype = layer.kv_cache.dtype
    # reads T*kv_heads*head_dim*2, writes the same into the paged cache
    layer.impl.do_kv_cache_update(layer, k.to(dtype).contiguous(), v.to(dtype).contiguous(), layer.kv_cache,
                                  slot_mapping[: k.shape[0]])


@dataclass
class SlotWritingAttention:
    """The fusor's attention backend for one request under any vLLM backend (Fusor.attention_backend):
    writes each layer's merged K/V into the request's slots, attends with the fusor's kernels."""

    writes_kv: ClassVar[bool] = True
    layers: dict[str, Any]
    """Attention layers by name (the step's forward_context.no_compile_layers)."""
    layer_names: list[str]
    """Attention layer name of each model layer, in order."""
    slot_mapping: torch.Tensor
    """int64 [num_tokens] on the cache's device: the slot of every prompt position."""
    scale: float
    block_rows: int = 64
    rows_attention: Callable[..., torch.Tensor] = field(default=ops.rows_attention)
    """(q, q_positions, k, v, scale, block_rows) over contiguous K/V, for caches not read in place."""
    slot_rows_attention: Callable[..., torch.Tensor] = field(default=ops.slot_rows_attention)
    """(q, q_positions, k_cache, v_cache, key_slots, scale, block_rows): the rows over the paged cache."""
    read_in_place: dict[str, bool] = field(default_factory=dict, init=False)
    """Per layer name, once it has attended: whether its rows read the paged cache in place."""

    def causal(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        write_layer_kv(self.layers[self.layer_names[layer_index]], k, v, self.slot_mapping)
        return causal_attention(q, k, v, self.scale)

    def rows(self, layer_index: int, q: torch.Tensor, q_positions: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> torch.Tensor:
        name = self.layer_names[layer_index]
        layer = self.layers[name]
        write_layer_kv(layer, k, v, self.slot_mapping)
        views = paged_kv_views(layer)
        in_place = views is not None and views[0].dtype == q.dtype
        self.read_in_place[name] = in_place
        if not in_place:
            return self.rows_attention(q, q_positions, k, v, self.scale, self.block_rows)
        return self.slot_rows_attention(q, q_positions, views[0], views[1], self.slot_mapping[: k.shape[0]],
                                        self.scale, self.block_rows)


@dataclass
class PagedAttention:
    """The fusor's attention backend for one request on vLLM's CPU backend (Fusor.attention_backend)."""

    writes_kv: ClassVar[bool] = True

    layers: dict[str, Any]
    """Attention layers by name (the step's forward_context.no_compile_layers)."""
    layer_names: list[str]
    """Attention layer name of each model layer, in order."""
    slot_mapping: torch.Tensor
    """int64 [num_tokens]: the slot of every prompt position."""
    block_table: torch.Tensor
    """int32 [1, num_blocks]: the request's blocks."""

    def causal(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the whole prompt; q [T, heads, head_dim], k/v [T, kv_heads, head_dim]."""
        num_tokens = q.shape[0]
        return self._attend(layer_index, q, k, v, torch.tensor([0, num_tokens], dtype=torch.int32),
                            torch.tensor([num_tokens], dtype=torch.int32), self.block_table)

    def rows(self, layer_index: int, q: torch.Tensor, q_positions: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> torch.Tensor:
        """Rows at `q_positions` [R] over the merged K/V [T, kv_heads, head_dim], each seeing keys <= its position."""
        num_rows = q.shape[0]
        return self._attend(layer_index, q, k, v, torch.arange(num_rows + 1, dtype=torch.int32),
                            (q_positions + 1).to(torch.int32), self.block_table.expand(num_rows, -1).contiguous())

    def _attend(self, layer_index, q, k, v, query_start_loc, seq_lens, block_table) -> torch.Tensor:
        from vllm import envs
        from vllm._custom_ops import cpu_attn_get_scheduler_metadata
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

        layer = self.layers[self.layer_names[layer_index]]
        impl = layer.impl
        slots = self.slot_mapping[: k.shape[0]]
        write_layer_kv(layer, k, v, self.slot_mapping)
        num_seqs = seq_lens.numel()
        scheduler_metadata = cpu_attn_get_scheduler_metadata(
            num_reqs=num_seqs, num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
            head_dim=impl.head_size, seq_lens=seq_lens, dtype=q.dtype, query_start_loc=query_start_loc,
            causal=True, sliding_window_size=impl.sliding_window, isa=layer.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=impl.kv_cache_dtype)
        metadata = CPUAttentionMetadata(
            num_actual_tokens=q.shape[0], max_query_len=int((query_start_loc[1:] - query_start_loc[:-1]).max()),
            query_start_loc=query_start_loc, max_seq_len=int(seq_lens.max()), seq_lens=seq_lens,
            block_table=block_table, slot_mapping=slots, scheduler_metadata=scheduler_metadata, causal=True)
        out = torch.empty_like(q)
        impl.forward(layer, q.contiguous(), k, v, layer.kv_cache, metadata, output=out)
        return out

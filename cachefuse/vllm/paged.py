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
(cachefuse.vllm.cache_views: the CPU backend's packed keys, any fp8 cache) attends over the layer's
merged K/V in memory instead (cachefuse.ops.rows_attention), with the same result: over an fp8 cache,
over the K/V rounded as the cache holds them (cachefuse.vllm.kv_quant).

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
import torch.nn.functional as F

from cachefuse import ops
from cachefuse.attention import causal_attention
from cachefuse.fusion.batch import Attend
from cachefuse.fusion.batch_ops import window_kwargs
from cachefuse.vllm import kv_quant
from cachefuse.vllm.cache_views import paged_kv_views
from cachefuse.vllm.messages import NULL_BLOCK_ID


def supports_paged_attention(layer: Any) -> bool:
    """True for vLLM's CPU attention backend (the one PagedAttention drives)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    except ImportError:  # a vLLM build without the CPU backend
        return False
    return isinstance(layer.impl, CPUAttentionBackendImpl) and hasattr(layer, "isa")


def write_layer_kv(layer: Any, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                   first_written: int = 0) -> None:
    """One layer's K/V [T, kv_heads, head_dim] into the slots of positions first_written..T-1 through the
    layer's own writer (an fp8 cache: quantized there with the layer's scales, as vLLM's own writes are;
    see cachefuse.vllm.kv_quant). Positions before `first_written` (`unwritten_prefix`: vLLM's prefix-cache
    hit, shared with other requests, or vLLM's null block) are never written; positions past
    the slots (an asynchronous load's last token, which vLLM computes) are not written either."""
    dtype = kv_quant.write_dtype(layer)
    num_rows = min(k.shape[0], slot_mapping.shape[0])
    if num_rows <= first_written:
        return
    k, v = k[first_written:num_rows], v[first_written:num_rows]
    # reads T*kv_heads*head_dim*2, writes the same into the paged cache
    layer.impl.do_kv_cache_update(layer, k.to(dtype).contiguous(), v.to(dtype).contiguous(), layer.kv_cache,
                                  slot_mapping[first_written:num_rows])


def unwritten_prefix(block_ids: list[int], block_size: int, cached_prefix_tokens: int) -> int:
    """Positions at the prompt's start that the blend pass computes and attends over in memory, never
    writing or reading them in the paged cache:

    - vLLM's prefix-cache hit (`BlendPlan.cached_prefix_tokens`): its blocks are shared with other requests,
      and the request that computes them may be in this very step, its forward still to come when the
      blend runs (vLLM caches a block's hash when it allocates it, before it is computed): read in place,
      they could be stale;
    - vLLM's null block: a sliding-window model's external tokens that no later row's window reaches
      (`leading_unslotted`).
    """
    return max(leading_unslotted(block_ids, block_size), cached_prefix_tokens)


def leading_unslotted(block_ids: list[int], block_size: int) -> int:
    """Positions at the prompt's start that have no slot of their own: vLLM's sliding-window cache manager
    gives the external tokens that no later row's window reaches the null block. 0 for a model without
    windows (every block real)."""
    num_null = 0
    for block_id in block_ids:
        if block_id != NULL_BLOCK_ID:
            break
        num_null += 1
    return num_null * block_size


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
    """(q, q_positions, k, v, scale, block_rows, and `window=` for a windowed layer) over contiguous K/V, for
    caches not read in place."""
    slot_rows_attention: Callable[..., torch.Tensor] = field(default=ops.slot_rows_attention)
    """(q, q_positions, k_cache, v_cache, key_slots, scale, block_rows, and `window=`): the rows over the
    paged cache."""
    windows: tuple[int | None, ...] = ()
    """Each model layer's sliding window (ModelShape.layer_windows; empty: none)."""
    paged_from: int = 0
    """Positions below it are written nowhere and attended in memory (`unwritten_prefix`)."""
    read_in_place: dict[str, bool] = field(default_factory=dict, init=False)
    """Per layer name, once it has attended: whether its rows read the paged cache in place."""

    def _window(self, layer_index: int) -> dict[str, int]:
        return window_kwargs(self.windows[layer_index] if self.windows else None)

    def causal(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layer = self.layers[self.layer_names[layer_index]]
        write_layer_kv(layer, k, v, self.slot_mapping, self.paged_from)
        return causal_attention(q, *kv_quant.as_read_from_cache(layer, k, v), self.scale, **self._window(layer_index))

    def rows(self, layer_index: int, q: torch.Tensor, q_positions: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> torch.Tensor:
        name = self.layer_names[layer_index]
        layer = self.layers[name]
        write_layer_kv(layer, k, v, self.slot_mapping, self.paged_from)
        views = paged_kv_views(layer)
        # keys past the slots (an asynchronous load's last token) or before them (the null block) live only in
        # memory
        in_place = (views is not None and views[0].dtype == q.dtype and k.shape[0] <= self.slot_mapping.shape[0]
                    and self.paged_from == 0)
        self.read_in_place[name] = in_place
        if not in_place:  # over the K/V as the cache holds them (an fp8 cache: rounded to its codes)
            k, v = kv_quant.as_read_from_cache(layer, k, v)
            return self.rows_attention(q, q_positions, k, v, self.scale, self.block_rows, **self._window(layer_index))
        return self.slot_rows_attention(q, q_positions, views[0], views[1], self.slot_mapping[: k.shape[0]],
                                        self.scale, self.block_rows, **self._window(layer_index))


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
    paged_from: int = 0
    """Positions below it are written nowhere (`unwritten_prefix`); rows whose window reaches them attend in
    memory."""

    def causal(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the whole prompt; q [T, heads, head_dim], k/v [T, kv_heads, head_dim]."""
        return self.attend_many([Attend(layer_index, self, q, None, k, v)])[0]

    def rows(self, layer_index: int, q: torch.Tensor, q_positions: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> torch.Tensor:
        """Rows at `q_positions` [R] over the merged K/V [T, kv_heads, head_dim], each seeing keys <= its position."""
        return self.attend_many([Attend(layer_index, self, q, q_positions, k, v)])[0]

    @staticmethod
    def attend_many(attends: list[Attend]) -> list[torch.Tensor]:
        """One layer's attention of several requests (each op's backend a PagedAttention over the same
        layers) in one call of the paged kernel: each request's merged K/V written into its own slots,
        then its rows as sequences over its own blocks only (a causal layer one sequence of T rows,
        selected rows one single-token sequence each), so no row sees another request's keys."""
        first = attends[0].backend
        layer = first.layers[first.layer_names[attends[0].layer]]
        window = layer.impl.sliding_window if layer.impl.sliding_window > 0 else None  # the CPU impl's -1: none
        width = max(op.backend.block_table.shape[1] for op in attends)
        query_lens, seq_lens, tables, paged_q, in_memory = [], [], [], [], []
        for index, op in enumerate(attends):
            backend = op.backend
            write_layer_kv(layer, op.k, op.v, backend.slot_mapping, backend.paged_from)
            table = F.pad(backend.block_table, (0, width - backend.block_table.shape[1]))  # pad: never read
            num_slots = backend.slot_mapping.shape[0]
            positions = op.query_rows
            if positions is None and op.q.shape[0] <= num_slots and backend.paged_from == 0:
                query_lens.append(torch.tensor([op.q.shape[0]], dtype=torch.int32))  # one causal sequence
                seq_lens.append(torch.tensor([op.q.shape[0]], dtype=torch.int32))
                tables.append(table)
                paged_q.append(op.q)
                continue
            if positions is None:
                positions = torch.arange(op.q.shape[0], device=op.q.device)
            # Rows are paged from `begin` to `end` (positions are sorted); the others attend over the layer's
            # merged K/V in memory (as the cache would hold them): an asynchronous load's blocks stop at position
            # N-2 (vLLM computes N-1 itself), and a window that reaches the null block's positions would read
            # keys never written.
            num_rows = op.q.shape[0]
            end = int((positions < num_slots).sum())
            begin = min(_rows_reaching(positions, backend.paged_from, window), end)
            query_lens.append(torch.ones(end - begin, dtype=torch.int32))
            seq_lens.append((positions[begin:end] + 1).to(torch.int32).cpu())
            tables.append(table.expand(end - begin, -1))
            paged_q.append(op.q[begin:end])
            if begin > 0 or end < num_rows:
                rest = torch.cat([torch.arange(begin), torch.arange(end, num_rows)]).to(positions.device)
                in_memory.append((index, begin, ops.rows_attention(
                    op.q[rest], positions[rest], *kv_quant.as_read_from_cache(layer, op.k, op.v), layer.impl.scale,
                    **window_kwargs(window))))
        query_start_loc = F.pad(torch.cat(query_lens).cumsum(0, dtype=torch.int32), (1, 0))
        q = paged_q[0] if len(paged_q) == 1 else torch.cat(paged_q)
        out = q.new_empty(q.shape)
        if q.shape[0]:
            out = paged_forward(layer, q, attends[0].k, attends[0].v, query_start_loc, torch.cat(seq_lens),
                                 torch.cat(tables).contiguous())
        outs = list(torch.split(out, [part.shape[0] for part in paged_q]))
        for index, begin, rows in in_memory:  # rows: those before the paged ones, then those after
            outs[index] = torch.cat([rows[:begin], outs[index], rows[begin:]])
        return outs


def _rows_reaching(positions: torch.Tensor, paged_from: int, window: int | None) -> int:
    """How many of the sorted `positions` see a key below `paged_from` (all of them without a window)."""
    if paged_from == 0:
        return 0
    if window is None:
        return int(positions.shape[0])
    return int((positions - window + 1 < paged_from).sum())


def paged_forward(layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor,
                   seq_lens: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU attention over the paged cache for sequences already written (decoder attention reads
    the cache only: `k`/`v` are not read, nor the slot mapping)."""
    from vllm import envs
    from vllm._custom_ops import cpu_attn_get_scheduler_metadata
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    impl = layer.impl
    num_seqs = seq_lens.numel()
    scheduler_metadata = cpu_attn_get_scheduler_metadata(
        num_reqs=num_seqs, num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
        head_dim=impl.head_size, seq_lens=seq_lens, dtype=q.dtype, query_start_loc=query_start_loc,
        causal=True, sliding_window_size=impl.sliding_window, isa=layer.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=impl.kv_cache_dtype)
    metadata = CPUAttentionMetadata(
        num_actual_tokens=q.shape[0], max_query_len=int((query_start_loc[1:] - query_start_loc[:-1]).max()),
        query_start_loc=query_start_loc, max_seq_len=int(seq_lens.max()), seq_lens=seq_lens,
        block_table=block_table, slot_mapping=torch.empty(0, dtype=torch.int64),
        scheduler_metadata=scheduler_metadata, causal=True)
    out = torch.empty_like(q)
    impl.forward(layer, q.contiguous(), k, v, layer.kv_cache, metadata, output=out)
    return out

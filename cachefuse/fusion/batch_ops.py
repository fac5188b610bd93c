"""One op of several blend passes run as one (the ops of cachefuse.fusion.batch, executed for the Fusor).

Imports torch and cachefuse.fusion.batch; never vllm. Rows of every pass are concatenated and each model
op (embedding, norm + projections + RoPE, o_proj + MLP, logits) is called once for all of them: each is
row-wise, so a row's result is the one it gets alone. Attention is the exception: each request's rows
attend only to its own merged K/V, through one varlen call for the passes on the fusor's own attention,
one `attend_many` call for a backend that has it (vLLM's paged kernel), or one call per request. The
passes' sums over the tensor-parallel ranks (`RankSum`) cross the ranks in one all-reduce.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from cachefuse.fusion.batch import Attend, Embed, Logits, Output, Project, RankSum, split_rows


def run_ops(ops: list[Any], adapter: Any, attend_one: Callable[..., torch.Tensor],
            varlen_rows_attention: Callable[..., torch.Tensor], block_rows: int,
            sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[Any]:
    """The results of `ops` (one per pass, same stage and layer), in order.

    Args:
        adapter: the ModelAdapter whose ops run.
        attend_one: (backend, layer, q, query_rows, k, v) -> attention of one request (Fusor._attend).
        varlen_rows_attention: (q, q_positions, cu_rows, k, v, cu_keys, scale, block_rows): selected rows
            of several requests, each over its own keys (ops.varlen_rows_attention).
        block_rows: rows per attention block.
        sum_over_ranks: an all-reduce (sum) over the tensor-parallel group; None: one rank (a pass yields
            no RankSum then).
    """
    first = ops[0]
    if isinstance(first, RankSum):
        return _sum_over_ranks(ops, sum_over_ranks)
    if isinstance(first, Attend):
        return _attend_many(ops, attend_one, varlen_rows_attention, adapter.shape.scaling, block_rows,
                            adapter.shape.window(first.layer))
    counts = [_rows_of(op) for op in ops]
    if isinstance(first, Embed):
        return split_rows(adapter.embed(_cat([op.token_ids for op in ops])), counts)
    if isinstance(first, Project):
        x, residual = adapter.attention_input(first.layer, _cat([op.hidden for op in ops]),
                                              _cat_or_none([op.residual for op in ops]))
        q_nope, k_nope, v = adapter.project_qkv(first.layer, x)
        q, k = adapter.rotate(first.layer, _cat([op.positions for op in ops]), q_nope, k_nope)
        return list(zip(*(split_rows(t, counts) for t in (q, k, k_nope, v, residual)), strict=True))
    if isinstance(first, Output):
        hidden, residual = adapter.attention_output(first.layer, _cat([op.attn for op in ops]),
                                                    _cat([op.residual for op in ops]))
        return list(zip(split_rows(hidden, counts), split_rows(residual, counts), strict=True))
    if isinstance(first, Logits):
        logits = adapter.final_logits(_cat([op.hidden for op in ops]), _cat([op.residual for op in ops]))
        return split_rows(logits, counts)
    raise TypeError(f"no such pass op: {type(first).__name__}")


def _attend_many(ops: list[Attend], attend_one: Callable[..., torch.Tensor],
                 varlen_rows_attention: Callable[..., torch.Tensor], scale: float,
                 block_rows: int, window: int | None) -> list[torch.Tensor]:
    """Each request's rows over its own merged K/V (one layer: one sliding `window`, None: none). Requests
    on the fusor's own attention whose rows are selected go in one varlen call; a backend with `attend_many`
    (vLLM's paged kernel) takes its requests in one call; anything else attends request by request."""
    out: list[torch.Tensor | None] = [None] * len(ops)
    varlen = [i for i, op in enumerate(ops) if op.backend is None and op.query_rows is not None]
    if len(varlen) > 1:
        attns = _varlen_rows([ops[i] for i in varlen], varlen_rows_attention, scale, block_rows, window)
        for i, attn in zip(varlen, attns, strict=True):
            out[i] = attn
    by_backend: dict[type, list[int]] = {}
    for i, op in enumerate(ops):
        if out[i] is None and op.backend is not None and hasattr(op.backend, "attend_many"):
            by_backend.setdefault(type(op.backend), []).append(i)
    for backend_type, indices in by_backend.items():
        if len(indices) > 1:
            for i, attn in zip(indices, backend_type.attend_many([ops[i] for i in indices]), strict=True):
                out[i] = attn
    for i, op in enumerate(ops):
        if out[i] is None:
            out[i] = attend_one(op.backend, op.layer, op.q, op.query_rows, op.k, op.v)
    return out


def _varlen_rows(ops: list[Attend], varlen_rows_attention: Callable[..., torch.Tensor], scale: float,
                 block_rows: int, window: int | None) -> list[torch.Tensor]:
    """Selected rows of several requests in one varlen call: request b's rows see only its own keys (within
    the layer's sliding `window`, None: none)."""
    device = ops[0].q.device
    cu_rows = torch.tensor([0, *itertools.accumulate(op.q.shape[0] for op in ops)], device=device)
    cu_keys = torch.tensor([0, *itertools.accumulate(op.k.shape[0] for op in ops)], device=device)
    attn = varlen_rows_attention(
        _cat([op.q for op in ops]), _cat([op.query_rows for op in ops]), cu_rows,
        _cat([op.k for op in ops]), _cat([op.v for op in ops]), cu_keys, scale, block_rows, **window_kwargs(window))
    return split_rows(attn, [op.q.shape[0] for op in ops])


def _sum_over_ranks(ops: list[RankSum], sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None
                    ) -> list[torch.Tensor]:
    """Each pass's values summed over the ranks, in one all-reduce of all of them (fp32: the hit flags are
    small integers, exact in it, and the scores are fp32 already)."""
    if sum_over_ranks is None:
        raise RuntimeError("a pass asked for a sum over tensor-parallel ranks in an engine of one rank")
    flat = [op.values.float().flatten() for op in ops]
    summed = sum_over_ranks(torch.cat(flat))  # a copy: an all-reduce may sum in place
    return [part.view(op.values.shape) for part, op in zip(split_rows(summed, [t.numel() for t in flat]), ops,
                                                            strict=True)]


def window_kwargs(window: int | None) -> dict[str, int]:
    """`window=` for an attention call of a layer with a sliding window, nothing otherwise: a full-attention
    layer calls its attention function exactly as a model without windows does."""
    return {} if window is None else {"window": window}


def _rows_of(op: Any) -> int:
    """Rows an op carries (the count to cut the batched result back by)."""
    if isinstance(op, Embed):
        return int(op.token_ids.shape[0])
    if isinstance(op, Output):
        return int(op.attn.shape[0])
    return int(op.hidden.shape[0])  # Project, Logits


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One request's tensor as it is (no copy); several concatenated by rows."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _cat_or_none(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Layer 0's residual is None for every pass of a batch (they start together), a tensor after."""
    if any(t is None for t in tensors):
        assert all(t is None for t in tensors), "passes batched at different depths"
        return None
    return _cat(tensors)

"""QCFuse's anchors chosen offline and stored in each chunk's metadata, where the `qcfuse` selector reads them.

Imports torch, cachefuse.{adapters.base, attention, select.qcfuse, store.base}. The ranking and storing
of anchors (`choose_anchors`, `with_anchors`) live in select/qcfuse.py, where hole saves reach them at
serving time; this module adds what needs the model offline (`received_attention`). Two rankings of a
chunk's tokens (the first `sink_tokens` are always anchors, then the highest ranked, ceil(r_a x |c|)
in all, as `select.qcfuse.rank_anchors` counts them):

- "key_norm": the mean L2 norm of the token's stored keys over layers and KV heads. A function of the
  stored entry alone; it is also what the selector derives per request when an entry has no anchors.
- "attention": the attention the token receives from the chunk's own tokens, computed after the
  chunk's prefix (the prefix it was stored after), averaged over heads and layers, divided by the
  number of chunk rows that can see it (a causal mask lets early tokens collect mass from more rows;
  H2O's accumulated attention, normalised). Needs the model: one extra prefill of the chunk offline.

Stored anchors are only used when their ratio and sink count match the serving config
(`select.qcfuse.anchors_from_meta`); anything else falls back to the key-norm anchors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cachefuse.adapters.base import ModelAdapter
from cachefuse.attention import causal_attention, segment_attention_mass
from cachefuse.select.qcfuse import RANKINGS, choose_anchors, with_anchors
from cachefuse.store.base import ChunkKV


@torch.inference_mode()
def received_attention(adapter: ModelAdapter, token_ids: Sequence[int], chunk_start: int,
                       block_rows: int = 64) -> torch.Tensor:
    """fp32 [len(token_ids) - chunk_start] on the CPU: each chunk token's attention received from the chunk's
    rows (the prompt is `[prefix][chunk]`, the chunk from `chunk_start`), averaged over heads and layers,
    per viewing row."""
    shape, device = adapter.shape, adapter.device
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=device)
    num_tokens = ids.numel()
    if not 0 <= chunk_start < num_tokens:
        raise ValueError(f"chunk_start={chunk_start} outside a prompt of {num_tokens} tokens")
    positions = torch.arange(num_tokens, device=device)
    chunk_rows = positions[chunk_start:]
    received = torch.zeros(num_tokens, dtype=torch.float32, device=device)
    hidden, residual = adapter.embed(ids), None
    for layer in range(shape.num_layers):
        x, residual = adapter.attention_input(layer, hidden, residual)
        q_nope, k_nope, v = adapter.project_qkv(layer, x)
        q, k = adapter.rotate(layer, positions, q_nope, k_nope)
        window = shape.window(layer)
        mass = segment_attention_mass(q[chunk_start:], chunk_rows, k, positions, num_tokens, shape.scaling,
                                      block_rows, window=window)  # [num_heads, num_tokens]: every key a segment
        received += mass.mean(dim=0)
        if layer < shape.num_layers - 1:
            attn = causal_attention(q, k, v, shape.scaling, window)
            hidden, residual = adapter.attention_output(layer, attn.flatten(1), residual)
    viewers = (num_tokens - chunk_rows).float()  # chunk rows at or after each chunk token
    return (received[chunk_start:] / shape.num_layers / viewers).cpu()


def anchor_annotator(adapter: ModelAdapter, prefix_ids: Sequence[int], ranking: str, ratio: float,
                     sink_tokens: int):
    """An `annotate` for FusionEngine.precompute: stores each chunk's anchors by `ranking` (the attention
    ranking runs the chunk after `prefix_ids`, as it is stored)."""
    if ranking not in RANKINGS:
        raise ValueError(f"anchor ranking {ranking!r}: expected one of {', '.join(RANKINGS)}")

    def annotate(chunk_ids: Sequence[int], entry: ChunkKV) -> ChunkKV:
        scores = None
        if ranking == "attention":
            scores = received_attention(adapter, [*prefix_ids, *chunk_ids], len(prefix_ids))
        offsets = choose_anchors(entry, ranking, ratio, sink_tokens, scores)
        return with_anchors(entry, offsets, ranking, ratio, sink_tokens)

    return annotate

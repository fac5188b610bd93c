"""QCFuse's anchors chosen offline and stored in each chunk's metadata, where the `qcfuse` selector reads them.

Imports torch, cachefuse.{adapters.base, attention, chunks, select.qcfuse, store.base}. The ranking and
storing of anchors (`choose_anchors`, `with_anchors`) live in select/qcfuse.py, where hole saves reach
them at serving time; this module adds what needs the model offline (`received_attention`,
`reconstruction_attention`). Three rankings of a chunk's tokens (the first `sink_tokens` are always
anchors, then the highest ranked, ceil(r_a x |c|) in all, as `select.qcfuse.rank_anchors` counts them):

- "key_norm": the mean L2 norm of the token's stored keys over layers and KV heads. A function of the
  stored entry alone; it is also what the selector derives per request when an entry has no anchors.
- "attention": the attention the token receives from the chunk's own tokens, computed after the
  chunk's prefix (the prefix it was stored after), averaged over heads and layers, divided by the
  number of chunk rows that can see it (a causal mask lets early tokens collect mass from more rows;
  H2O's accumulated attention, normalised). Needs the model: one extra prefill of the chunk offline.
- "kvzip": KVzip's context-reconstruction score (Kim et al. 2025), QCFuse's default ranking. The model
  is asked to repeat the chunk: `[prefix][chunk][repeat prompt][chunk]`, and each chunk token's score
  is the largest softmax probability any row of the repeat part (prompt and copy) gives it, over every
  query head and every layer. KVzip keeps a score per (layer, KV head) and evicts pairs below one global
  threshold; a token is kept by some pair exactly when its maximum over them clears that threshold, so
  the maximum orders tokens the way KVzip's threshold would reach them, as one anchor set per chunk
  (QCFuse's Eq. 14) needs. Needs the model: one prefill of about twice the chunk offline.

```
ids:     | prefix (system) | chunk c | "Repeat the previous context exactly." + turn end | chunk c |
keys:    |        all of them, causal                                                            |
scored:                    | c       |
queries:                             | every row from here ----------------------------------->|
```

Stored anchors are only used when their ratio and sink count match the serving config
(`select.qcfuse.anchors_from_meta`); anything else falls back to the key-norm anchors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cachefuse.adapters.base import ModelAdapter
from cachefuse.attention import causal_attention, segment_attention_mass, visible_keys
from cachefuse.rag_prompt import chat_pieces, tokenize_piece
from cachefuse.select.qcfuse import RANKINGS, choose_anchors, with_anchors
from cachefuse.store.base import ChunkKV

KVZIP_REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
"""KVzip's reconstruction request, asked right after the chunk (its reference code's wording)."""


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


def kvzip_repeat_ids(tokenizer) -> list[int]:
    """The ids between the chunk and its copy: the repeat request, then the end of the user's turn and
    the assistant's header of the tokenizer's chat template (plain text "Answer: " without one), as
    KVzip's reference code closes its request with the model's template."""
    pieces = chat_pieces(tokenizer, "")
    return tokenize_piece(tokenizer, KVZIP_REPEAT_PROMPT + (pieces.question_suffix if pieces else "\n\nAnswer: "))


@torch.inference_mode()
def reconstruction_attention(adapter: ModelAdapter, prefix_ids: Sequence[int], chunk_ids: Sequence[int],
                             repeat_ids: Sequence[int], block_rows: int = 64) -> torch.Tensor:
    """fp32 [len(chunk_ids)] on the CPU: KVzip's score of each chunk token (see the module doc).

    Args:
        prefix_ids: what the chunk is stored after (the system prompt).
        repeat_ids: the reconstruction request (`kvzip_repeat_ids`); the chunk's copy follows it.
    """
    shape, device = adapter.shape, adapter.device
    if not chunk_ids or not repeat_ids:
        raise ValueError(f"kvzip scoring needs a chunk and a repeat prompt ({len(chunk_ids)}, {len(repeat_ids)} ids)")
    ids = torch.tensor([*prefix_ids, *chunk_ids, *repeat_ids, *chunk_ids], dtype=torch.int64, device=device)
    chunk_start, chunk_end = len(prefix_ids), len(prefix_ids) + len(chunk_ids)
    positions = torch.arange(ids.numel(), device=device)
    score = torch.zeros(len(chunk_ids), dtype=torch.float32, device=device)
    hidden, residual = adapter.embed(ids), None
    for layer in range(shape.num_layers):
        x, residual = adapter.attention_input(layer, hidden, residual)
        q_nope, k_nope, v = adapter.project_qkv(layer, x)
        q, k = adapter.rotate(layer, positions, q_nope, k_nope)
        k_heads = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # GQA: [T, num_heads, head_dim]
        for start in range(chunk_end, ids.numel(), block_rows):
            rows = positions[start:start + block_rows]
            logits = torch.einsum("rhd,khd->hrk", q[rows].float(), k_heads) * shape.scaling  # [H, R, T]
            visible = visible_keys(rows, positions, shape.window(layer))  # [R, T]
            probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
            score = torch.maximum(score, probs[..., chunk_start:chunk_end].amax(dim=(0, 1)))
        if layer < shape.num_layers - 1:
            attn = causal_attention(q, k, v, shape.scaling, shape.window(layer))
            hidden, residual = adapter.attention_output(layer, attn.flatten(1), residual)
    return score.cpu()


def anchor_annotator(adapter: ModelAdapter, prefix_ids: Sequence[int], ranking: str, ratio: float,
                     sink_tokens: int, repeat_ids: Sequence[int] = ()):
    """An `annotate` for FusionEngine.precompute: stores each chunk's anchors by `ranking` (the model
    rankings run the chunk after `prefix_ids`, as it is stored; "kvzip" needs `repeat_ids`)."""
    if ranking not in RANKINGS:
        raise ValueError(f"anchor ranking {ranking!r}: expected one of {', '.join(RANKINGS)}")
    if ranking == "kvzip" and not repeat_ids:
        raise ValueError("anchor ranking 'kvzip' needs repeat_ids (cachefuse.offline.anchors.kvzip_repeat_ids)")

    def annotate(chunk_ids: Sequence[int], entry: ChunkKV) -> ChunkKV:
        scores = None
        if ranking == "attention":
            scores = received_attention(adapter, [*prefix_ids, *chunk_ids], len(prefix_ids))
        elif ranking == "kvzip":
            scores = reconstruction_attention(adapter, prefix_ids, chunk_ids, repeat_ids)
        offsets = choose_anchors(entry, ranking, ratio, sink_tokens, scores)
        return with_anchors(entry, offsets, ranking, ratio, sink_tokens)

    return annotate

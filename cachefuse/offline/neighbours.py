"""Offline neighbour fusion (FusionRAG): each chunk also stored as computed after its most similar chunks.

A base variant is a chunk computed after the system prompt alone, so it has seen no other document.
FusionRAG's offline stage guesses which documents a chunk will be retrieved with (its top-N
neighbours by embedding similarity over the knowledge base) and stores the chunk computed after them:

```
| system (loaded) | neighbour 1 (base, loaded) | ... | neighbour N (base, loaded) | chunk (computed in full) | 1 |
```

The neighbours are loaded and not recomputed, the paper's Eq. 10 (the chunk attends to the
neighbours' cached K/V); the chunk is a hole of a `full_reuse` pass, so the engine saves it as the
variant whose prefix is those neighbours, with the attention statistics of its rows. Nothing
else changes: Cache-Craft's scores (CCI, beta, gamma, CFO: cachefuse/metadata) decide when a prompt
reuses it. A prompt holding the neighbours in that order scores it CFO 0; in another order, or with
some of them, by beta and gamma; with none of them it loses to the base variant.

Choices the paper leaves open:
- Which K/V of a neighbour: the variant Cache-Craft scores best in its place, as a served prompt
  would load it: the base variant (the paper's), or a neighbour variant stored earlier in the run
  whose prefix fits that place better (closer to full attention). Chunks run in index order, so a
  run is deterministic. Those loads count as uses (f_r), like a served request's.
- Neighbour order: most similar first (the paper's top-1 ... top-n), so the most similar chunk is the
  farthest from the chunk and the prefix keeps its rank order.
- Similarity: cosine of the embeddings; ties go to the earlier chunk. A chunk is never its own
  neighbour, nor is a chunk with the same token ids (same key), nor one of similarity <= 0 (so a
  chunk may have fewer than N neighbours, and its variant a shorter prefix).
- Default embedder: the served model's own final hidden states (after its last norm) of the chunk's
  tokens computed alone, averaged over tokens (`model_embedder`). `lexical_embedder` (TF-IDF over
  token ids: chunks naming the same rare things) is the model-free alternative; any callable from
  token-id lists to an `[n, d]` array may replace either (a sentence encoder, say).
- Prefix length: a variant's prefix holds at most `max_variant_prefix_chunks` chunks (default 16), so
  larger N is cut to that many (logged; the CLI refuses such an N at start-up instead).
- Loading the neighbours: as under `default_variant: base` whatever the engine's setting (the paper's
  Eq. 10 attends to the neighbours' base caches).

Origin: the variant is saved marked `neighbour_fused` (cachefuse.metadata.base, choice 9), which is what
`default_variant: fused` loads wherever the chunk is not first; served holes are never marked.

Resumable: a chunk whose neighbour variant is already in the metadata store is skipped. One stored for
that prefix but not marked (by cachefuse before records carried their origin, or a served prompt's hole
that held exactly those neighbours, in that order: the same computation) is marked, not recomputed.
Imports numpy and tqdm at module level; torch only inside `model_embedder` (the reference engine it
is handed brings the model).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cachefuse.errors import StoreError

logger = logging.getLogger(__name__)

Embedder = Callable[[Sequence[Sequence[int]]], Any]
"""Token-id lists -> an [n, d] array-like of embeddings, one row per list."""


@dataclass
class NeighbourReport:
    """What one `fuse_neighbours` run did."""

    neighbours: list[list[int]]
    """Per chunk, the indices of its neighbours, most similar first."""
    stored: list[int] = field(default_factory=list)
    """Chunks whose neighbour variant this run computed and stored."""
    skipped: list[int] = field(default_factory=list)
    """Chunks whose neighbour variant was already stored (a resumed run), or that have no neighbour."""
    marked: list[int] = field(default_factory=list)
    """Skipped chunks whose stored variant for the neighbour prefix was not marked `neighbour_fused` and now is."""
    failed: list[int] = field(default_factory=list)
    """Chunks whose variant the store refused (full of pinned entries, unwritable)."""
    seconds: list[float] = field(default_factory=list)
    """Per stored chunk, the seconds its fused prefill and save took (the offline cost)."""


def top_neighbours(vectors: Any, count: int, token_ids: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """Per row of `vectors` [n, d], the indices of the `count` rows of highest cosine similarity.

    Excludes the row itself, rows of similarity <= 0 (nothing in common: a row may get fewer than
    `count`) and, given `token_ids`, rows with the same ids (one chunk listed twice). Ties go to the
    lower index. A zero vector has similarity 0 to everything, so it has no neighbours.
    """
    if count < 0:
        raise ValueError(f"count={count!r}: expected an integer >= 0")
    matrix = np.asarray(vectors, dtype=np.float64)
    if matrix.ndim != 2:
        raise ValueError(f"embeddings of shape {matrix.shape}: expected [num_chunks, dim]")
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    unit = np.divide(matrix, norms, out=np.zeros_like(matrix), where=norms > 0)
    similarity = unit @ unit.T
    same = [tuple(ids) for ids in token_ids] if token_ids is not None else None
    out = []
    for i in range(len(matrix)):
        order = sorted(range(len(matrix)), key=lambda j, row=similarity[i]: (-row[j], j))
        picked = [j for j in order
                  if j != i and similarity[i, j] > 1e-12 and (same is None or same[j] != same[i])]
        out.append(picked[:count])
    return out


def model_embedder(engine: Any) -> Embedder:
    """The served model's mean-pooled final hidden states of each chunk's ids, computed alone."""
    import torch

    model = engine.adapter.model

    @torch.inference_mode()
    def embed(chunks: Sequence[Sequence[int]]) -> np.ndarray:
        rows = []
        for ids in chunks:
            out = model.model(torch.tensor([list(ids)], dtype=torch.int64))
            rows.append(out.last_hidden_state[0].float().mean(dim=0).numpy())
        return np.stack(rows)

    return embed


def lexical_embedder(vocab_size: int) -> Embedder:
    """TF-IDF over token ids, fitted on the chunks it is given: chunks that share rare tokens (the
    same names) come out similar, whatever their topic or form. No model needed."""

    def embed(chunks: Sequence[Sequence[int]]) -> np.ndarray:
        counts = np.zeros((len(chunks), vocab_size), dtype=np.float64)
        for row, ids in enumerate(chunks):
            np.add.at(counts[row], np.asarray(list(ids), dtype=np.int64), 1.0)
        document_frequency = (counts > 0).sum(axis=0)
        idf = np.log((1 + len(chunks)) / (1 + document_frequency)) + 1.0
        return counts * idf

    return embed


def fuse_neighbours(engine: Any, system_ids: Sequence[int], chunks: Sequence[Sequence[int]], num_neighbours: int,
                    *, embedder: Embedder | None = None, progress: bool = True,
                    clock: Callable[[], float] = time.perf_counter) -> NeighbourReport:
    """Stores every chunk's base variant (if missing) and its neighbour variant (FusionRAG's offline stage).

    Args:
        engine: a cachefuse.fusion.engine.FusionEngine (the reference engine) over the store to fill.
        system_ids: the system prompt's ids ([BOS] + ids, as `build_rag_prompt` makes them): the prompt
            start every chunk is computed after.
        chunks: the knowledge base, one id list per chunk.
        num_neighbours: N, the neighbours per chunk (0: base variants only).
        embedder: `model_embedder(engine)` when None.
    """
    from tqdm.auto import tqdm

    if num_neighbours < 0:
        raise ValueError(f"num_neighbours={num_neighbours!r}: expected an integer >= 0 (0 stores base variants only)")
    if not system_ids:
        raise ValueError("system_ids is empty: neighbour variants are keyed after a system prompt")
    chunks = [list(c) for c in chunks]
    engine.precompute([list(system_ids)])
    engine.precompute(chunks, prefix_ids=list(system_ids))
    cap = engine.config.max_variant_prefix_chunks
    count = num_neighbours if cap is None else min(num_neighbours, cap)
    if count < num_neighbours:
        logger.warning("neighbour fusion: %d neighbours cut to max_variant_prefix_chunks=%d", num_neighbours, cap)
    if count == 0 or len(chunks) < 2:
        return NeighbourReport([[] for _ in chunks], skipped=list(range(len(chunks))))
    vectors = (embedder or model_embedder(engine))(chunks)
    if np.asarray(vectors).shape[0] != len(chunks):
        raise ValueError(f"the embedder returned {np.asarray(vectors).shape[0]} rows for {len(chunks)} chunks")
    report = NeighbourReport(top_neighbours(vectors, count, chunks))
    # Statistics on: the variant's CCI and ranking. Admission off: the neighbours are loaded, never
    # computed in full and stored themselves (cachefuse.metadata.index, rule 4). default_variant "base": a
    # neighbour loads its base variant unless a variant fits its place better (Eq. 10 loads base caches),
    # whatever the engine serves with (rule 8).
    fusion_config = engine.config.replace(collect_attention_stats=True, variant_admission_max_chunks=0,
                                          default_variant="base")
    for index in tqdm(range(len(chunks)), desc="neighbour fusion", unit="chunk", disable=not progress):
        neighbours = report.neighbours[index]
        prefix = tuple(engine.meta_key(chunks[j]) for j in neighbours)
        stored = _stored_variant(engine, engine.meta_key(chunks[index]), prefix) if neighbours else None
        if not neighbours or stored is not None:
            report.skipped.append(index)
            if stored is not None and not stored.neighbour_fused and _mark_neighbour_fused(engine, stored):
                report.marked.append(index)
            continue
        start = clock()
        if _store_neighbour_variant(engine, system_ids, chunks, index, neighbours, fusion_config, prefix):
            report.stored.append(index)
            report.seconds.append(clock() - start)
        else:
            report.failed.append(index)
    return report


def _store_neighbour_variant(engine: Any, system_ids: Sequence[int], chunks: list[list[int]], index: int,
                             neighbours: Sequence[int], fusion_config: Any, prefix: tuple[str, ...]) -> bool:
    """Chunk `index` computed in full after the system prompt and its neighbours (reused as stored) and saved
    as the neighbours' variant, under `fusion_config` (statistics on, admission off); whether it was stored."""
    token_ids, offsets = list(system_ids), [(0, len(system_ids))]
    for j in [*neighbours, index]:
        offsets.append((len(token_ids), len(token_ids) + len(chunks[j])))
        token_ids += chunks[j]
    token_ids.append(chunks[index][0])  # the last prompt token is always computed: not part of a chunk
    previous, engine.config = engine.config, fusion_config
    try:
        variants = list(engine.plan_variants(token_ids, offsets))
        variants[-1] = None  # the chunk itself: computed in full after its neighbours, saved as their variant
        _, stats = engine.prefill(token_ids, offsets, selector="full_reuse", ratio=0.0, variants=variants,
                                  save_holes=True, save_inline=True, neighbour_variant=True)
    finally:
        engine.config = previous
    meta_key = engine.meta_key(chunks[index])
    return any(r.chunk_key == meta_key and r.prefix == prefix for r in stats.saved_variants)


def _stored_variant(engine: Any, meta_key: str, prefix: tuple[str, ...]) -> Any:
    """The chunk's stored variant for `prefix` (a VariantRecord), or None."""
    return next((record for record in engine.metastore.variants(meta_key) if record.prefix == prefix), None)


def _mark_neighbour_fused(engine: Any, record: Any) -> bool:
    """Marks a stored variant for the neighbour prefix as the step's (an upsert of its row: its K/V, uses
    and statistics stay); False when the store refuses (logged: the chunk keeps loading its base variant)."""
    try:
        engine.metastore.put(dataclasses.replace(record, neighbour_fused=True))
    except StoreError as exc:
        logger.warning("neighbour fusion: variant %s not marked neighbour-fused (%s)", record.variant_id, exc)
        return False
    return True

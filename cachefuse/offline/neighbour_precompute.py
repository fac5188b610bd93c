"""Neighbour variants through vLLM (FusionRAG's offline stage, `cachefuse precompute --fuse-neighbours N`).

The same stage as cachefuse.offline.neighbours (read its docstring for the choices: neighbour order,
similarity, exclusions, the prefix cap), driven through a connector-enabled vLLM engine instead of
the reference engine, so the variants are computed by the engine that serves them. Each chunk with
neighbours is sent once as

```
| system | neighbour 1 | ... | neighbour N | chunk | tail (1 token) |
```

with `selector: full_reuse`, `recompute_ratio: 0`, `store_variant: true` and `sync_save: true`: the
neighbours are loaded (the variant scored best in their place, as a served prompt loads them: the
paper's Eq. 10), the chunk is computed in full after them and saved as the variant whose prefix is
those neighbours, with its attention statistics when the engine collects them (the CLI turns
`collect_attention_stats` on; without them the variant is stored with CCI 1 and no ranking).

Order: prompts go in batches of `batch_size` in chunk order; a neighbour variant written by an
earlier batch may be loaded by a later one, within a batch none of the batch's own (the scheduler
plans a batch before its saves land), so the store a run leaves depends on `batch_size`, and a run
is repeatable for a given one.

Origin: the engine `precompute_chunks` requires (`allow_sync_save`) saves a `store_variant` request's chunk
marked `neighbour_fused`, what `default_variant: fused` loads wherever the chunk is not first; a server
(without `allow_sync_save`) never marks one.

Resumable: base variants go through `precompute_chunks` (skipping stored ones), and a chunk whose
neighbour variant's K/V file is already listed under the store is skipped; one whose row is not marked
(stored before records carried their origin) is marked, not recomputed.

Imports the standard library, numpy (via neighbours) and cachefuse's torch-free modules at module
level; cachefuse.vllm only inside functions (never vllm itself: the engine is handed in).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachefuse.chunks import PARAMS_KEY, chunk_key
from cachefuse.config import CacheFuseConfig
from cachefuse.errors import ConfigError, StoreError
from cachefuse.metadata.base import VariantRecord, variant_store_key
from cachefuse.offline.neighbours import Embedder, top_neighbours
from cachefuse.offline.precompute import (
    PrecomputeReport,
    check_store,
    connector_config,
    precompute_chunks,
    rank0_kv_dir,
    scheduler_key_context,
    tail_token_id,
)
from cachefuse.rag_prompt import build_rag_prompt, tokenize_piece
from cachefuse.store.disk import list_keys

logger = logging.getLogger(__name__)


@dataclass
class NeighbourPrecomputeReport:
    """What one `precompute_neighbours` run did."""

    base: PrecomputeReport
    """The base variants' run (system prompt and every chunk computed after it alone)."""
    neighbours: list[list[int]] = field(default_factory=list)
    """Per chunk, the indices of its neighbours, most similar first."""
    stored: list[int] = field(default_factory=list)
    """Chunks whose neighbour variant this run stored."""
    skipped: list[int] = field(default_factory=list)
    """Chunks with no neighbour, or whose neighbour variant was stored before the run."""
    marked: list[int] = field(default_factory=list)
    """Skipped chunks whose stored neighbour variant was not marked `neighbour_fused` and now is."""
    failed: dict[int, str] = field(default_factory=dict)
    """Chunk -> why its variant is not stored (a fallback reason, "too_long", "not_saved")."""
    seconds_per_chunk: float | None = None
    """Mean wall seconds per stored variant (its batch's generate call over the batch's size)."""

    @property
    def ok(self) -> bool:
        return self.base.ok and not self.failed


def checkpoint_embedder(model_dir: str | Path) -> Embedder:
    """The model's mean-pooled final hidden states (after its last norm) of each chunk computed alone:
    FusionRAG's default, read from the checkpoint with transformers (the engine's model is not
    reachable through vLLM's API)."""
    import numpy as np
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()

    @torch.inference_mode()
    def embed(chunks: Sequence[Sequence[int]]) -> Any:
        rows = [model(torch.tensor([list(ids)], dtype=torch.int64)).last_hidden_state[0].mean(dim=0).numpy()
                for ids in chunks]
        return np.stack(rows)

    return embed


def precompute_neighbours(llm: Any, tokenizer: Any, system: str, chunks: Sequence[str], num_neighbours: int, *,
                          store_dir: str | Path, embedder: Embedder | None = None,
                          config: CacheFuseConfig | None = None, batch_size: int = 16, progress: bool = True,
                          clock: Callable[[], float] = time.perf_counter) -> NeighbourPrecomputeReport:
    """Stores the base variants, then each chunk computed after its `num_neighbours` nearest chunks.

    NOTE: over a screen: the planning of each chunk's prompt (skipped, stored already, too long) reads the
    keys, the stored keys, the tokenizer's prompt and the report together; the generation is its own
    function (`_generate_variants`).

    Args:
        llm: a `vllm.LLM` running CacheFuseConnector over `store_dir` (see `precompute_chunks`).
        tokenizer: the model's tokenizer.
        system: the system prompt every RAG prompt starts with; required (variants are keyed after it).
        chunks: the knowledge base, chunk texts tokenized on their own as `build_rag_prompt` does.
        num_neighbours: N (0: base variants only); cut to `max_variant_prefix_chunks`.
        embedder: token-id lists -> [n, d] vectors; default the served model's own
            (`checkpoint_embedder` on the engine's checkpoint); `lexical_embedder` needs no model.

    Raises:
        ConfigError: as `precompute_chunks`, or an empty system prompt, or N < 0.
    """

    if num_neighbours < 0:
        raise ConfigError(f"num_neighbours={num_neighbours!r} is invalid: expected an integer >= 0")
    if not system:
        raise ConfigError("system='' is invalid for neighbour variants: they are keyed after a system prompt")
    vllm_config = llm.llm_engine.vllm_config
    engine_config = connector_config(vllm_config)
    store = check_store(engine_config, store_dir)
    config = config or engine_config
    texts = list(chunks)
    base = precompute_chunks(llm, tokenizer, system, texts, store_dir=store, config=config, batch_size=batch_size,
                             progress=progress)
    report = NeighbourPrecomputeReport(base)
    ids = [tokenize_piece(tokenizer, text) for text in texts]
    cap = engine_config.max_variant_prefix_chunks
    count = num_neighbours if cap is None else min(num_neighbours, cap)
    if count == 0 or len(texts) < 2:
        report.neighbours, report.skipped = [[] for _ in texts], list(range(len(texts)))
        return report
    if embedder is None:
        from cachefuse.chunks import resolve_model_dir

        embedder = checkpoint_embedder(resolve_model_dir(vllm_config.model_config))
    vectors = embedder(ids)
    report.neighbours = top_neighbours(vectors, count, ids)
    key_context = scheduler_key_context(vllm_config, config)
    keys = [chunk_key(chunk, key_context) if chunk else None for chunk in ids]
    kv_dir = rank0_kv_dir(vllm_config, engine_config)
    # Stored means both halves: a save writes its K/V, then its metadata row, so a run killed in between
    # leaves a file nothing loads (a leftover), which must not count as done when the run resumes.
    rows = _variant_rows(engine_config)
    stored_keys = list_keys(kv_dir) & rows.keys()
    max_model_len = vllm_config.model_config.max_model_len
    tail_id = tail_token_id(tokenizer)
    todo: list[tuple[int, str, list[int], list[list[int]]]] = []
    unmarked: dict[int, VariantRecord] = {}
    for index, neighbours in enumerate(report.neighbours):
        if not neighbours or keys[index] is None or any(keys[j] is None for j in neighbours):
            report.skipped.append(index)
            continue
        target = variant_store_key(keys[index], tuple(keys[j] for j in neighbours))
        if target in stored_keys:
            report.skipped.append(index)
            if not rows[target].neighbour_fused:
                unmarked[index] = rows[target]
            continue
        prompt = build_rag_prompt(tokenizer, system, [texts[j] for j in [*neighbours, index]], "")
        token_ids = [*prompt.token_ids, tail_id]
        if len(token_ids) >= max_model_len:
            report.failed[index] = "too_long"
            continue
        todo.append((index, target, token_ids, [[s, e] for s, e in prompt.chunks]))
    report.marked = _mark_neighbour_fused(engine_config, unmarked)
    seconds = _generate_variants(llm, todo, kv_dir, report, batch_size=batch_size, progress=progress, clock=clock)
    if report.stored:
        report.seconds_per_chunk = seconds / len(todo)
    logger.info("neighbour variants: %d stored, %d skipped, %d failed of %d chunks (N=%d, store %s)",
                len(report.stored), len(report.skipped), len(report.failed), len(texts), count, store)
    return report


def _generate_variants(llm: Any, todo: list[tuple[int, str, list[int], list[list[int]]]], kv_dir: Path,
                       report: NeighbourPrecomputeReport, *, batch_size: int, progress: bool,
                       clock: Callable[[], float]) -> float:
    """Runs the planned prompts (index, target key, token ids, chunk spans) through the engine in batches,
    recording each chunk stored or failed in `report`; returns the seconds spent generating."""
    from tqdm.auto import tqdm

    seconds = 0.0
    bar = tqdm(total=len(todo), unit="chunk", desc="neighbour variants", disable=not progress)
    for at in range(0, len(todo), batch_size):
        batch = todo[at: at + batch_size]
        start = clock()
        outputs = llm.generate([{"prompt_token_ids": token_ids} for _, _, token_ids, _ in batch],
                               [_sampling_params(spans) for _, _, _, spans in batch], use_tqdm=False)
        seconds += clock() - start
        stored_keys = list_keys(kv_dir)
        for (index, target, _, _), output in zip(batch, outputs, strict=True):
            reason = _outcome(output, target in stored_keys)
            if reason is None:
                report.stored.append(index)
            else:
                report.failed[index] = reason
                logger.warning("neighbour variants: chunk %d not stored (%s)", index, reason)
        bar.update(len(batch))
    bar.close()
    return seconds


def _variant_rows(config: CacheFuseConfig) -> dict[str, VariantRecord]:
    """The engine's metadata rows by their variants' store keys."""
    from cachefuse.metadata.backends import open_config_metastore

    metastore = open_config_metastore(config)
    try:
        return {record.store_key: record for record in metastore.all_records()}
    finally:
        metastore.close()


def _mark_neighbour_fused(config: CacheFuseConfig, records: dict[int, VariantRecord]) -> list[int]:
    """Marks stored neighbour variants (chunk index -> row) as the step's; returns the chunks marked (a row
    the store refuses is logged and left as it was: its chunk keeps loading its base variant)."""
    if not records:
        return []
    from cachefuse.metadata.backends import open_config_metastore

    marked = []
    metastore = open_config_metastore(config)
    try:
        for index, record in records.items():
            try:
                metastore.put(dataclasses.replace(record, neighbour_fused=True))
            except StoreError as exc:
                logger.warning("neighbour variants: chunk %d's variant not marked neighbour-fused (%s)", index, exc)
                continue
            marked.append(index)
    finally:
        metastore.close()
    return marked


def _sampling_params(spans: list[list[int]]) -> Any:
    from cachefuse.vllm.engines import sampling_params

    return sampling_params(max_tokens=1, temperature=0.0, cachefuse={
        "chunks": spans, "selector": "full_reuse", "recompute_ratio": 0.0, "store_variant": True, "sync_save": True})


def _outcome(output: Any, stored: bool) -> str | None:
    """None when the variant is stored; else why not."""
    params = getattr(output, "kv_transfer_params", None)
    outcome = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    if isinstance(outcome, dict) and outcome.get("fallback_reason"):
        return str(outcome["fallback_reason"])
    return None if stored else "not_saved"

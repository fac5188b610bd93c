"""Question probe: a short pre-pass that scores each cached context token by the question's attention.

Imports torch and cachefuse.{adapters.base, attention, chunks, fusion.batch, fusion.batch_ops, ops, select.base,
store.base}; never vllm.
Query-aware selectors (FusionRAG, QCFuse) pick the rows to recompute *before* the blend pass, from
how much the question attends to each context token. The probe computes only the forced rows
(holes, undeclared tokens, question, last token) through layers 0..depth-1, attending over a *view*
of the loaded caches, and at each score layer scores every cached row by the question's softmax
attention to it. It never writes a cached row and its K/V are dropped: the blend pass that follows
recomputes the forced rows with the selected rows refreshed before them.

```
prompt:   | system | chunk A . a . . a | hole | chunk B a . . . | question |
view:     | system |         a     a   | hole |         a       | question |   (anchors; or every row)
scored:            | every row of A    |      | every row of B  |              (at the score layers)
```

Choices (docs/selectors.md, "Query-aware selectors"):
- Score of a context token at layer l: its softmax attention probability from each question row
  (full denominator: every key the row can see, the question's own keys included, as QCFuse's
  reference code), summed over question rows and heads, summed over the score layers. The keys scored
  are the full context's loaded keys at their request positions, whatever the view.
- Question rows: every row after the last declared chunk (the prompt's tail), else the last token.
- The view always holds the system chunk in full: it is the prefix every probe row needs and is
  never a candidate. Anchor rows keep their request positions (not compacted), as QCFuse does.
- Under tensor parallelism each rank scores its own heads; a RankSum op of the pass sums them, so every
  rank selects the same rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cachefuse import ops
from cachefuse.adapters.base import ModelAdapter
from cachefuse.attention import rows_attention_at, segment_attention_mass
from cachefuse.chunks import Segment
from cachefuse.fusion.batch import Embed, LayerDone, Output, PassSteps, Project, run_alone, summed_over_ranks
from cachefuse.fusion.batch_ops import run_ops
from cachefuse.select.base import ProbeSpec, SelectionContext
from cachefuse.store.base import ChunkKV, select_rows


@dataclass
class ProbeResult:
    scores: torch.Tensor
    """[num_candidates] fp32, aligned with `ctx.candidate_rows`; higher: more attended by the question."""
    num_layers_run: int
    """Layers the probe rows went through (the deepest score layer + 1)."""
    num_view_rows: int
    """Cached rows the probe attended over (system + anchors, or every loaded row)."""
    num_probe_rows: int
    """Rows the probe computed (the forced rows)."""
    layer_scores: dict[int, torch.Tensor] | None = None
    """Score layer -> its scores alone (summing to `scores`), when `spec.per_layer`."""


def question_rows(segments: Sequence[Segment], num_tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rows after the last declared chunk; the last token alone when the prompt ends inside a chunk."""
    start = max((s.end for s in segments if s.is_chunk), default=num_tokens)
    return torch.arange(min(start, num_tokens - 1), num_tokens, device=device)


class ProbeSource(Protocol):
    """Where the probe reads the loaded chunks: whole entries already loaded (`EntrySource`), or the store
    itself, only what the probe needs (`cachefuse.loading.probe_reads.StoreProbeReads`)."""

    def indices(self) -> list[int]:
        """Segment indices of the loaded chunks, sorted."""
        ...

    def meta(self, index: int) -> Mapping[str, str]: ...

    def rows(self, index: int, layer: int, offsets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """K (RoPE-free) and V of the chunk's `offsets` rows (None: every row) at `layer`."""
        ...

    def keys(self, index: int, layer: int) -> torch.Tensor:
        """K (RoPE-free) of every row of the chunk at `layer`."""
        ...

    def layer_keys(self, index: int) -> Sequence[torch.Tensor]:
        """Every layer's K of the chunk, as a sequence (read on access by a store source)."""
        ...


class EntrySource:
    """A ProbeSource over whole entries already loaded (preload_depth 0)."""

    def __init__(self, loaded: Mapping[int, ChunkKV]) -> None:
        self.loaded = loaded

    def indices(self) -> list[int]:
        return sorted(self.loaded)

    def meta(self, index: int) -> Mapping[str, str]:
        return self.loaded[index].meta

    def rows(self, index: int, layer: int, offsets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self.loaded[index]
        return select_rows(entry.k_nope[layer], entry.v[layer], offsets, values=True)

    def keys(self, index: int, layer: int) -> torch.Tensor:
        return self.loaded[index].k_nope[layer]

    def layer_keys(self, index: int) -> Sequence[torch.Tensor]:
        return self.loaded[index].k_nope


def _view_offsets(index: int, seg: Segment, spec: ProbeSpec, anchors: Mapping[int, torch.Tensor]) -> torch.Tensor | None:
    """Chunk-local offsets of the rows the probe attends over (None: every row of the chunk)."""
    if seg.is_system:
        return None
    if spec.question_only:
        return torch.zeros(0, dtype=torch.int64)
    if not spec.anchors_only:
        return None
    return anchors[index]


class _CachedContext:
    """The loaded rows of one request, per layer: the view's K/V and, at score layers, every row's K."""

    def __init__(self, segments: Sequence[Segment], source: ProbeSource, spec: ProbeSpec,
                 anchors: Mapping[int, torch.Tensor], rope_spec, device: torch.device, num_tokens: int) -> None:
        self.source, self.rope_spec, self.device = source, rope_spec, device
        self.parts = []  # (segment index, chunk-local view offsets or None: all, view positions, all positions)
        for index in source.indices():
            seg = segments[index]
            offsets = _view_offsets(index, seg, spec, anchors)
            # The last token is always computed afresh (a forced row): a prompt that ends inside a loaded
            # chunk leaves that row's loaded K/V out, or the probe would attend to position N-1 twice.
            length = seg.length - 1 if seg.end == num_tokens else seg.length
            if length < seg.length:
                offsets = torch.arange(length) if offsets is None else offsets[offsets < length]
            every = torch.arange(seg.start, seg.start + length, device=device)
            view = every if offsets is None else seg.start + offsets.to(device)
            self.parts.append((index, offsets, view, every))
        self.view_positions = (torch.cat([p[2] for p in self.parts]) if self.parts
                               else torch.zeros(0, dtype=torch.int64, device=device))
        self.all_positions = (torch.cat([p[3] for p in self.parts]) if self.parts
                              else torch.zeros(0, dtype=torch.int64, device=device))

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K (rotated at request positions) and V of the view rows, in `view_positions` order."""
        # Only the view's rows travel to the model's device (anchors: ~r_a of each chunk; none of a chunk
        # outside a question-only view, which is not read at all).
        pairs = [self.source.rows(index, layer, offsets) for index, offsets, _, _ in self.parts
                 if offsets is None or offsets.numel()]
        if not pairs:  # no loaded chunk, or a question-only view
            return torch.zeros(0, device=self.device), torch.zeros(0, device=self.device)
        k_nope = torch.cat([k.to(self.device, non_blocking=True) for k, _ in pairs])
        v = torch.cat([v.to(self.device, non_blocking=True) for _, v in pairs])
        return ops.apply_rope(k_nope, self.view_positions, self.rope_spec), v

    def all_keys(self, layer: int) -> torch.Tensor:
        """K of every loaded row, rotated at its request position, in `all_positions` order."""
        k_nope = torch.cat([self.source.keys(index, layer)[: every.numel()].to(self.device, non_blocking=True)
                            for index, _, _, every in self.parts])
        return ops.apply_rope(k_nope, self.all_positions, self.rope_spec)

    def layer(self, layer: int, view: bool, scored: bool):
        """The view's K/V (when `view`) and every loaded row's K (when `scored`) at `layer`, None where not
        asked or nothing is loaded. With the full view both are the same rows: rotated once."""
        if not self.parts:
            return None, None, None
        view_k, view_v = self.view(layer) if view else (None, None)
        if not scored:
            return view_k, view_v, None
        view_is_all = self.view_positions.numel() == self.all_positions.numel()  # no anchors: the same rows
        return view_k, view_v, view_k if view_k is not None and view_is_all else self.all_keys(layer)


def probe_steps(token_ids: torch.Tensor, segments: Sequence[Segment], loaded: Mapping[int, ChunkKV] | ProbeSource,
                forced_rows: torch.Tensor, ctx: SelectionContext, spec: ProbeSpec, anchors: Mapping[int, torch.Tensor],
                shape, rope_spec, block_rows: int = 64, across_ranks: bool = False) -> PassSteps:
    """Scores `ctx.candidate_rows` by the question's attention at `spec.score_layers` (see the module doc),
    as a generator of the ops it needs of the model (cachefuse.fusion.batch), returning a ProbeResult: its
    embedding, projections and outputs run batched with the other passes' ops, and under tensor parallelism
    (`across_ranks`) its score sum is a RankSum op, so the probe's code runs no collective of its own.

    Args:
        loaded: segment index -> its stored entry (whole), or a ProbeSource (the probe reads only the
            view's rows of layers below the deepest score layer and every row's K at the score layers).
        forced_rows: sorted rows computed in every layer (holes, undeclared, question, last).
        anchors: segment index -> sorted chunk-local offsets, for each loaded non-system chunk when
            `spec.anchors_only`.
        shape, rope_spec: the model's (ModelAdapter.shape, .rope_spec).
    """
    num_tokens = int(token_ids.numel())
    device = token_ids.device
    source = EntrySource(loaded) if isinstance(loaded, Mapping) else loaded
    context = _CachedContext(segments, source, spec, anchors, rope_spec, device, num_tokens)
    key_positions, order = torch.cat([context.view_positions, forced_rows]).sort()
    question = torch.searchsorted(forced_rows, question_rows(segments, num_tokens, device))
    score_layers = list(spec.score_layers)
    scores = torch.zeros(num_tokens, dtype=torch.float32, device=device)
    per_layer: list[torch.Tensor] = []
    hidden, residual = (yield Embed(token_ids[forced_rows])), None
    for layer in range(spec.depth):
        q, k, _, v, residual = yield Project(layer, hidden, residual, forced_rows)
        last = layer == spec.depth - 1  # the deepest score layer needs no attention output
        view_k, view_v, all_k = context.layer(layer, view=not last, scored=layer in score_layers)
        if layer in score_layers:
            layer_score = _question_scores(q[question], forced_rows[question], k, forced_rows, all_k,
                                           context.all_positions, num_tokens, shape.scaling, block_rows,
                                           shape.window(layer))
            scores += layer_score
            if spec.per_layer:
                per_layer.append(layer_score[ctx.candidate_rows])
        if not last:
            keys = torch.cat([view_k.to(k.dtype), k])[order] if view_k is not None else k
            values = torch.cat([view_v.to(v.dtype), v])[order] if view_v is not None else v
            attn = rows_attention_at(q, forced_rows, keys, values, key_positions, shape.scaling, block_rows,
                                     shape.window(layer))
            hidden, residual = yield Output(layer, attn.flatten(1), residual)
        # charged to the step's blend budget as the pass's own layers are (the probe's rows are part of the
        # blend's work), and a point where a split blend may pause
        yield LayerDone(layer, int(forced_rows.numel()), num_tokens)
    # Each rank scored its own heads: the total and the per-layer shares cross the ranks in one sum
    summed = yield from summed_over_ranks(torch.stack([scores[ctx.candidate_rows], *per_layer]), spec.depth - 1,
                                          across_ranks)
    layer_scores = dict(zip(score_layers, summed[1:], strict=True)) if spec.per_layer else None
    return ProbeResult(summed[0], spec.depth, int(context.view_positions.numel()), int(forced_rows.numel()),
                       layer_scores)


def run_probe(adapter: ModelAdapter, token_ids: torch.Tensor, segments: Sequence[Segment],
              loaded: Mapping[int, ChunkKV] | ProbeSource, forced_rows: torch.Tensor, ctx: SelectionContext,
              spec: ProbeSpec, anchors: Mapping[int, torch.Tensor], block_rows: int = 64) -> ProbeResult:
    """`probe_steps` on its own, on one rank: each op run as it is asked for."""
    steps = probe_steps(token_ids, segments, loaded, forced_rows, ctx, spec, anchors, adapter.shape,
                        adapter.rope_spec, block_rows)
    return run_alone(steps, lambda ops: run_ops(ops, adapter, None, None, block_rows))


def _question_scores(q_question, question_positions, fresh_k, forced_rows, loaded_k, loaded_positions,
                     num_tokens: int, scale: float, block_rows: int, window: int | None) -> torch.Tensor:
    """[num_tokens] fp32: each key's attention probability from the question rows, summed over rows and heads."""
    k_full = fresh_k.new_empty((num_tokens, *fresh_k.shape[1:]))
    if loaded_k is not None:
        k_full[loaded_positions] = loaded_k.to(fresh_k.dtype)
    k_full[forced_rows] = fresh_k  # every row is loaded or forced: k_full is fully written
    key_ids = torch.arange(num_tokens, device=fresh_k.device)  # every key is its own "segment"
    mass = segment_attention_mass(q_question, question_positions, k_full, key_ids, num_tokens,
                                  scale, block_rows, window=window)  # [num_heads, num_tokens]
    return mass.sum(dim=0)

"""Fusor: the layer-wise blend pass (CacheBlend section 4, generalised over selectors).

Imports torch, cachefuse.{adapters.base, attention, chunks, fusion.batch, fusion.batch_ops, fusion.layers,
fusion.plan, fusion.probe, ops, select.base, store.base}; never vllm. The pass is a generator of its
row-wise ops (fusion.batch), run alone (`fuse`) or batched with other requests' (`execute_ops`).
Given a prompt, its segments and the loaded RoPE-stripped chunk caches, it re-rotates cached K to
target positions, runs the selector's full layers over every row, then recomputes only the
selected rows plus the forced ones (holes, undeclared tokens, question, last token), attending
with an exact per-query causal mask over the merged K/V. Stored tensors are only ever read: every
merged K/V is a new tensor. Chunk K/V come whole (`FuseRequest.loaded`) or layer by layer from a fetch
(`FuseRequest.fetch_layer`), pipelined on a loader thread that also re-rotates K (docs/loading.md);
both give the same bytes.

```
| system (loaded) | chunk A (loaded, candidates) | chunk B (hole) | question | last |
0                                                                      N-1    N
layers 0..f-1: every row        layers f..L-1: selected + forced rows over merged K/V
```
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cachefuse import ops
from cachefuse.adapters.base import ModelAdapter
from cachefuse.attention import causal_attention, segment_attention_mass
from cachefuse.chunks import Segment, is_candidate_chunk
from cachefuse.fusion.batch import (
    START_LAYER,
    Attend,
    Embed,
    LayerDone,
    Logits,
    Output,
    PassSteps,
    Project,
    RankSum,
    run_alone,
    summed_over_ranks,
)
from cachefuse.fusion.batch_ops import run_ops, window_kwargs
from cachefuse.fusion.layers import LoadedLayers
from cachefuse.fusion.plan import FuseRequest, FuseResult
from cachefuse.fusion.probe import EntrySource, ProbeResult, ProbeSource, probe_steps
from cachefuse.select.base import CheckLayerKV, SelectionContext, Selector
from cachefuse.store.base import ChunkKV

RowsAttention = Callable[..., torch.Tensor]


class _RequestLayout:
    """Per-request row bookkeeping: which rows are loaded, candidates or forced."""

    def __init__(self, request: FuseRequest, num_layers: int, device: torch.device) -> None:
        num_tokens = int(request.token_ids.numel())
        is_loaded = torch.zeros(num_tokens, dtype=torch.bool, device=device)
        is_candidate = torch.zeros(num_tokens, dtype=torch.bool, device=device)
        candidate_segments, self.hole_segments = [], []
        for index, seg in enumerate(request.segments):
            entry = request.loaded.get(index)
            if index in request.fetched:
                if entry is not None or request.fetch_layer is None:
                    raise ValueError(f"segment {index}: fetched needs fetch_layer and excludes loaded")
            elif entry is None:
                if seg.is_chunk:
                    self.hole_segments.append(index)
                continue
            else:
                _check_entry(entry, seg, num_layers)
            is_loaded[seg.start:seg.end] = True
            reuse = request.reuse.get(index)
            if is_candidate_chunk(seg.is_system, reuse is not None and reuse.exact):
                is_candidate[seg.start:seg.end] = True
                candidate_segments.append(seg)
        is_candidate[num_tokens - 1] = False  # the last token is always computed, never "selected"
        forced = ~is_loaded
        forced[num_tokens - 1] = True
        self.num_tokens, self.device = num_tokens, device
        self.token_ids = request.token_ids.to(device)
        self.is_candidate = is_candidate
        self.forced_rows = forced.nonzero().flatten()
        self.ctx = SelectionContext(
            num_tokens=num_tokens, num_layers=num_layers, segments=tuple(request.segments),
            candidate_rows=is_candidate.nonzero().flatten(),
            candidate_segments=tuple(candidate_segments), ratio=float(request.ratio), reuse=dict(request.reuse))

    def with_forced(self, selected: torch.Tensor) -> torch.Tensor:
        return torch.cat([selected, self.forced_rows]).unique(sorted=True)

    def with_forced_disjoint(self, candidates: torch.Tensor) -> torch.Tensor:
        """`with_forced` of candidate rows, which are never forced: a sort, where `unique` would wait for
        the device to learn its output size (a sync that drains the GPU mid-pass)."""
        return torch.cat([candidates, self.forced_rows]).sort().values


def _check_entry(entry: ChunkKV, seg: Segment, num_layers: int) -> None:
    if entry.num_layers != num_layers or entry.num_tokens != seg.length:
        raise ValueError(
            f"loaded entry has {entry.num_layers} layers x {entry.num_tokens} tokens, "
            f"segment at {seg.start} needs {num_layers} x {seg.length}")


class Fusor:
    """Runs the blend pass over a ModelAdapter.

    Args:
        adapter: the model behind the ModelAdapter protocol.
        block_rows: selected rows per attention call.
        attention_fn: rows attention (q, q_positions, k, v, scale, block_rows, and `window=` for a layer with a
            sliding window): ops.rows_attention, the Triton sparse-query kernel on CUDA and its torch twin
            elsewhere; tests substitute it.
        sum_over_ranks: under tensor parallelism an all-reduce (sum) over the ranks, so every rank
            selects the same rows from scores over all heads (and agrees on hits); None on one rank. The
            pass never calls it: it yields RankSum ops, which `execute_ops` runs through it.
        clock: time source of the layer and probe timings on a CPU (injectable: tests never read wall
            time); on a GPU the default clock gives way to CUDA events.
        varlen_attention_fn: rows attention of several requests in one call (q, q_positions, cu_rows, k,
            v, cu_keys, scale, block_rows, and `window=` as attention_fn; ops.varlen_rows_attention): batched passes (cachefuse.fusion.batch).

    The attention backend is the request's (`FuseRequest.attention_backend`): it is bound to where that
    request's K/V go (vLLM's slots), so it travels with the request rather than living on the fusor.
    """

    def __init__(self, adapter: ModelAdapter, block_rows: int = 64,
                 attention_fn: RowsAttention = ops.rows_attention,
                 sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 varlen_attention_fn: RowsAttention = ops.varlen_rows_attention) -> None:
        self.adapter = adapter
        self.block_rows = block_rows
        self.attention_fn = attention_fn
        self.varlen_attention_fn = varlen_attention_fn
        self.sum_over_ranks = sum_over_ranks
        self.clock = clock

    def fuse(self, request: FuseRequest, selector: Selector) -> FuseResult:
        """One pass on its own: `fuse_steps` with each op run as it is asked for."""
        return run_alone(self.fuse_steps(request, selector), self.execute_ops)

    @torch.inference_mode()
    def fuse_steps(self, request: FuseRequest, selector: Selector) -> PassSteps:
        """The pass as a generator of the row-wise ops it needs (cachefuse.fusion.batch): run alone
        (`fuse`) or batched with other requests' passes and split across engine steps (PassBatch)."""
        shape = self.adapter.shape
        layout = _RequestLayout(request, shape.num_layers, self.adapter.device)
        num_full = selector.num_full_layers(shape.num_layers)
        check_layers = selector.check_layers(shape.num_layers)
        probe = yield from self._probe(request, selector, layout)
        # With no full layer the selection needs nothing the pass computes: it is made before any layer is
        # fetched (a query-aware selector selects, then loads, as QCFuse does).
        initial = selector.initial_rows(layout.ctx) if num_full == 0 else None
        with LoadedLayers(request, layout.num_tokens, shape, self.adapter.rope_spec, num_full,
                           set(check_layers), layout.device) as loaded_kv:
            result = yield from self._fuse(request, selector, layout, loaded_kv, num_full, check_layers, initial)
        if probe is not None:
            result.probe_seconds, result.probe_layers, result.probe_rows = probe
        return result

    @torch.inference_mode()
    def execute_ops(self, ops: list[Any]) -> list[Any]:
        """One op of several passes (same stage, same layer) run as one (cachefuse.fusion.batch_ops)."""
        return run_ops(ops, self.adapter, self._attend, self.varlen_attention_fn, self.block_rows, self.sum_over_ranks)

    def _probe(self, request: FuseRequest, selector: Selector, layout: _RequestLayout) -> PassSteps:
        """Runs the question probe a query-aware selector asks for (its ops yielded, batched with the other
        passes'); its scores go into `layout.ctx`. Returns (seconds, layers, rows) or None: no probe. Its
        time includes waiting for the other passes of its batch, as a batched layer's does."""
        spec = selector.probe_spec(self.adapter.shape.num_layers)
        if spec is None:
            return None
        source: ProbeSource = EntrySource(request.loaded)
        if request.fetched:
            if request.probe_source is None:
                raise ValueError(f"{selector.name}: a layer-by-layer fetch needs FuseRequest.probe_source "
                                 "for the question probe (or whole entries, preload_depth 0)")
            source = request.probe_source
        timer = _LayerTimer(self.clock, layout.device)
        timer.start()
        keys = {index: source.layer_keys(index) for index in source.indices()
                if spec.anchors_only and not spec.question_only and not request.segments[index].is_system}
        summed: dict[int, torch.Tensor | None] = dict.fromkeys(keys)
        if keys and self.sum_over_ranks is not None:  # every rank ranks by every head's keys: the same anchors
            partials = [selector.probe_anchor_partials(request.segments[i], k) for i, k in keys.items()]
            total = yield RankSum(torch.cat(partials), START_LAYER)
            summed = dict(zip(keys, total.split([p.numel() for p in partials]), strict=True))
        anchors = {index: selector.probe_anchors(request.segments[index], k, source.meta(index), summed[index])
                   for index, k in keys.items()}
        result: ProbeResult = yield from probe_steps(
            layout.token_ids, request.segments, source, layout.forced_rows, layout.ctx, spec, anchors,
            self.adapter.shape, self.adapter.rope_spec, self.block_rows, across_ranks=self.sum_over_ranks is not None)
        layout.ctx = dataclasses.replace(layout.ctx, probe_scores=result.scores, probe_layer_scores=result.layer_scores)
        timer.stop()
        return timer.seconds()[0], result.num_layers_run, result.num_probe_rows

    def _fuse(self, request: FuseRequest, selector: Selector, layout: _RequestLayout,
              loaded_kv: LoadedLayers, num_full: int, check_layers: tuple[int, ...],
              initial: torch.Tensor | None) -> PassSteps:
        """The layer loop (a generator of the pass's ops, returning its FuseResult); `loaded_kv` serves each layer's chunk K/V after `advance(layer)`; `initial`: the
        selection of a selector with no full layer, made before the loop.

        NOTE: longer than a screen on purpose: each step hands the next the rows, q, residual and merged
        K/V, and the order merge -> select -> attend is what the invariants rest on (a selected row's K/V
        are merged before any row attends to them). Cut into methods, those values would travel through
        ~10 parameters each and the order would be spread across them."""
        adapter, num_layers = self.adapter, self.adapter.shape.num_layers
        positions = torch.arange(layout.num_tokens, dtype=torch.int64, device=layout.device)
        rows: torch.Tensor | None = None  # rows whose K/V this layer computes; None: every row
        num_selected = layout.ctx.candidate_rows.numel()
        if num_full == 0:
            assert initial is not None, f"{selector.name}: no full layers needs initial_rows"
            rows, num_selected = layout.with_forced(initial), initial.numel()
        hidden = yield Embed(layout.token_ids if rows is None else layout.token_ids[rows])
        residual = None
        out_k, out_v, rows_per_layer = [], [], []
        keep_all_kv = not getattr(request.attention_backend, "writes_kv", False)
        hole_spans = [] if keep_all_kv else [request.segments[i] for i in layout.hole_segments]
        hole_kv: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {s.start: ([], []) for s in hole_spans}
        timer = _LayerTimer(self.clock, layout.device)
        stats = (_HoleStats(request.segments, layout) if request.collect_attention_stats and layout.hole_segments
                 else None)
        question = _QuestionAttention.of(request.segments, layout) if selector.tracks_question_attention() else None
        for layer in range(num_layers):
            timer.start()
            loaded_kv.advance(layer)  # blocks until this layer's chunk K/V are fetched (and rotated)
            row_positions = positions if rows is None else rows
            q, k, k_nope, v, residual = yield Project(layer, hidden, residual, row_positions)
            if rows is None:
                # Kept to the pass's end (keep_all_kv): their own memory, not views into the projection's
                # [T, q + 2 kv] output and the rotation's [T, q + kv] (6x and 5x the bytes on Llama-3-8B)
                k_merged, v_merged = (k.contiguous(), v.contiguous()) if keep_all_kv else (k, v)
            else:
                k_merged, v_merged = loaded_kv.rotated(layer)  # new tensors: safe to write rows into
                k_merged[rows], v_merged[rows] = k.to(k_merged.dtype), v.to(v_merged.dtype)
            if keep_all_kv:
                out_k.append(k_merged)
                out_v.append(v_merged)
            for seg in hole_spans:  # the only rows saving reads after the pass
                hole_kv[seg.start][0].append(k_merged[seg.start:seg.end].clone())
                hole_kv[seg.start][1].append(v_merged[seg.start:seg.end].clone())
            rows_per_layer.append(rows)
            window = adapter.shape.window(layer)
            if stats is not None:  # before q is cut down to the continuing rows
                stats.add_layer(q, row_positions, k_merged, adapter.shape.scaling, self.block_rows, window)
            tracked = None  # the selector's narrowed rows after this layer (Cache-Craft's early termination)
            if question is not None and layer < num_layers - 1:
                mass = question.partial_mass(q, row_positions, k_merged, adapter.shape.scaling, self.block_rows,
                                             window)
                mass = yield from summed_over_ranks(mass, layer, self.sum_over_ranks is not None)
                tracked = selector.after_layer(layout.ctx, layer, question.mass(mass))

            # Rows that continue to the next layer: only they need this layer's attention and MLP;
            # every row's K/V is already merged above.
            next_rows = rows
            if layer == num_layers - 1:
                next_rows = row_positions[-1:]  # only the last row feeds the logits
            elif layer in check_layers:
                chosen = yield from self._select_at_check(selector, layout, loaded_kv, layer, check_layers, rows,
                                                          k_nope, v)
                next_rows, num_selected = layout.with_forced_disjoint(chosen), chosen.numel()
            elif layer + 1 == num_full:
                initial = selector.initial_rows(layout.ctx)
                assert initial is not None, f"{selector.name}: full layers end without a selection"
                next_rows, num_selected = layout.with_forced(initial), initial.numel()
            elif tracked is not None:
                assert rows is not None, f"{selector.name}: after_layer narrowed rows in a full layer"
                next_rows, num_selected = layout.with_forced(tracked), tracked.numel()
            if next_rows is not None and next_rows is not rows:
                keep = torch.searchsorted(row_positions, next_rows)  # next_rows is a subset of rows
                q, residual = q[keep], residual[keep]
            attn = yield Attend(layer, request.attention_backend, q, next_rows, k_merged, v_merged)
            hidden, residual = yield Output(layer, attn.flatten(1), residual)
            timer.stop()
            yield LayerDone(layer, layout.num_tokens if rows is None else int(rows.numel()), layout.num_tokens)
            rows = next_rows

        logits = (yield Logits(hidden, residual))[0]  # the last row, position N-1
        if num_full >= num_layers:
            num_selected = layout.ctx.candidate_rows.numel()
        return FuseResult(
            k=out_k, v=out_v, logits=logits, rows_per_layer=rows_per_layer,
            num_candidates=layout.ctx.candidate_rows.numel(), num_selected=num_selected,
            num_forced=layout.forced_rows.numel(), hole_segments=layout.hole_segments,
            layer_seconds=timer.seconds(), hole_token_mass={} if stats is None else stats.result(num_layers),
            hole_kv=hole_kv)

    def _attend(self, backend, layer, q, query_rows, k, v) -> torch.Tensor:
        """Attention of `q` (rows `query_rows`, None: every row, causally) over the merged K/V, through the
        request's attention backend (None: the fusor's own torch / Triton attention)."""
        scale, window = self.adapter.shape.scaling, self.adapter.shape.window(layer)
        if query_rows is None:
            return causal_attention(q, k, v, scale, window) if backend is None else backend.causal(layer, q, k, v)
        if backend is None:
            return self.attention_fn(q, query_rows, k, v, scale, self.block_rows, **window_kwargs(window))
        return backend.rows(layer, q, query_rows, k, v)

    def _select_at_check(self, selector, layout, loaded_kv, layer, check_layers, rows, k_nope, v) -> PassSteps:
        """The selector's rows after check layer `layer`, which computed `rows` (None: every row).

        After a full layer (CacheBlend's check) the candidates are the layout's, their count known on the
        host: nothing is read back from the device, so the layers after the check are queued while the
        GPU still computes the full ones. A check after a selective layer (a multi-check schedule) masks
        the rows it computed, one sync."""
        if rows is None:
            candidate_rows = index = layout.ctx.candidate_rows  # row i of a full layer is position i
        else:
            index = layout.is_candidate[rows]  # [R] over the rows computed at this layer
            candidate_rows = rows[index]
        loaded_k_nope, loaded_v = loaded_kv.stripped(layer)
        kv = CheckLayerKV(
            rows=candidate_rows, fresh_k_nope=k_nope[index], fresh_v=v[index],
            loaded_k_nope=loaded_k_nope[candidate_rows], loaded_v=loaded_v[candidate_rows])
        check_index = check_layers.index(layer)
        partials = selector.check_partials(layout.ctx, check_index, kv)  # this rank's heads'
        summed = None if partials is None else (
            yield from summed_over_ranks(partials, layer, self.sum_over_ranks is not None))
        return selector.select_at_check(layout.ctx, check_index, kv, summed)


class _LayerTimer:
    """Each layer's time: the fusor's clock on a CPU; CUDA events on a GPU, where a host clock would time
    kernel launches, not kernels. `seconds()` waits for the last layer (the pass's one sync at its end)."""

    def __init__(self, clock: Callable[[], float], device: torch.device) -> None:
        self.clock = clock
        # An injected clock (tests) is kept on every device; the default one is replaced by events.
        self.events = device.type == "cuda" and clock is time.perf_counter
        self.spans: list[tuple[Any, Any]] = []
        self._start: Any = None

    def _now(self) -> Any:
        if not self.events:
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> None:
        self.spans.append((self._start, self._now()))

    def seconds(self) -> list[float]:
        if not self.events:
            return [end - start for start, end in self.spans]
        if self.spans:
            self.spans[-1][1].synchronize()
        return [start.elapsed_time(end) / 1000.0 for start, end in self.spans]


class _HoleStats:
    """Accumulates, per hole, the attention mass its rows put on each segment, layer by layer."""

    def __init__(self, segments: Sequence[Segment], layout: _RequestLayout) -> None:
        self.segments, self.holes = list(segments), list(layout.hole_segments)
        self.segment_of_key = _segment_of_key(self.segments, layout.device)
        self.per_token = {h: torch.zeros(self.segments[h].length, len(self.segments), device=layout.device)
                          for h in self.holes}

    def add_layer(self, q, row_positions, k_merged, scale, block_rows, window=None) -> None:
        for h in self.holes:
            seg = self.segments[h]
            hole_rows = torch.arange(seg.start, seg.end, device=row_positions.device)
            index = torch.searchsorted(row_positions, hole_rows)  # holes are always rows
            mass = segment_attention_mass(q[index], row_positions[index], k_merged, self.segment_of_key,
                                          len(self.segments), scale, block_rows, per_row=True, window=window)
            self.per_token[h] += mass.mean(dim=1)  # [tokens, segments], averaged over heads

    def result(self, num_layers: int) -> dict[int, list[list[float]]]:
        return {h: (mass / num_layers).tolist() for h, mass in self.per_token.items()}


class _QuestionAttention:
    """Per layer, the question rows' attention mass on each segment (Cache-Craft's inter^l(C_i, U)).

    Question rows: every row after the last declared chunk, the last token included; being no chunk,
    they are forced rows, computed in every layer (| ... | chunk C | glue, question, last |).
    """

    def __init__(self, segments: Sequence[Segment], num_tokens: int, question_start: int,
                 device: torch.device) -> None:
        self.rows = torch.arange(question_start, num_tokens, device=device)
        self.num_segments = len(segments)
        self.segment_of_key = _segment_of_key(segments, device)

    @classmethod
    def of(cls, segments: Sequence[Segment], layout: _RequestLayout) -> _QuestionAttention | None:
        """None when the prompt has no declared chunk or ends inside one (no question rows)."""
        start = max((s.end for s in segments if s.is_chunk), default=layout.num_tokens)
        return cls(segments, layout.num_tokens, start, layout.device) if start < layout.num_tokens else None

    def partial_mass(self, q, row_positions, k_merged, scale, block_rows, window: int | None = None) -> torch.Tensor:
        """[num_segments + 1] fp32: this rank's heads' mass per segment, summed over the question rows and
        heads, then its head count; summed over the ranks (one RankSum), `mass` averages it over every head."""
        index = torch.searchsorted(row_positions, self.rows)  # question rows are always computed
        mass = segment_attention_mass(q[index], self.rows, k_merged, self.segment_of_key,
                                      self.num_segments, scale, block_rows, window=window)  # [heads, segments]
        return torch.cat([mass.sum(dim=0), mass.new_tensor([mass.shape[0]])])

    @staticmethod
    def mass(summed: torch.Tensor) -> torch.Tensor:
        """[num_segments]: `partial_mass` (summed over the ranks) averaged over heads."""
        return summed[:-1] / summed[-1]


def _segment_of_key(segments: Sequence[Segment], device: torch.device) -> torch.Tensor:
    """int64 [num_tokens]: the index of the segment each row belongs to."""
    lengths = torch.tensor([s.length for s in segments], device=device)
    return torch.repeat_interleave(torch.arange(len(segments), device=device), lengths)

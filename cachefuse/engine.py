"""FusionEngine: one fused prefill end to end over a ModelAdapter (keys -> store -> fusor -> save).

Imports cachefuse.{chunks, config, fusor, loader, select, store}; never vllm. The reference engine (demo,
benchmarks, eval, tests) is this class over adapters.hf; the vLLM connector's worker side runs the
same steps over its own adapter. With `preload_depth` >= 1 (or None) chunk K/V are fetched layer by
layer during the pass (docs/loading.md); a layer that misses mid-pass re-runs the pass with that
chunk as a hole.

```
| system (chunk 0) | chunk A (hit) | chunk B (miss: hole, saved) | question | last |
```
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from cachefuse.adapters.base import ModelAdapter
from cachefuse.chunks import KeyContext, Segment, chunk_key, segment_prompt
from cachefuse.config import CacheFuseConfig
from cachefuse.fusor import FuseRequest, FuseResult, Fusor, extract_chunk_kv
from cachefuse.loader import FetchLayer, LayerKV, LayerUnavailable, store_layer_fetcher
from cachefuse.select import Selector, make_selector
from cachefuse.select.full_prefill import FullPrefillSelector
from cachefuse.store.base import ChunkKV, KVStore

logger = logging.getLogger(__name__)

DEFAULT_PRELOAD_DEPTH = 2
"""preload_depth=None's depth when no measured figures gave one (the controller's L_p, in the vLLM worker)."""


@dataclass
class FusionStats:
    """Per-request figures (the same names the vLLM connector reports)."""

    selector: str
    recompute_ratio: float
    chunks_hit: int
    chunks_missed: int
    tokens_reused: int
    """Loaded tokens whose K/V were kept as loaded in the last layer."""
    tokens_recomputed: int
    """Rows computed in the layers after the full ones: selected + holes + undeclared + last."""
    num_selected: int
    num_forced: int
    bytes_loaded: int
    blend_time_s: float
    holes_saved: int
    saved_keys: tuple[str, ...] = ()
    """Chunk keys stored by this request (holes)."""
    save_failures: int = 0
    """Holes the store refused (full of pinned entries, unwritable directory, ...)."""
    load_seconds_by_tier: dict[str, float] = field(default_factory=dict)
    """Time spent reading chunk entries, by the tier that served them (measured figures)."""
    load_bytes_by_tier: dict[str, int] = field(default_factory=dict)
    """Bytes read, by serving tier."""
    layer_seconds: list[float] = field(default_factory=list)
    """Blend-pass time of each layer (the compute figures' samples)."""
    layer_rows: list[int] = field(default_factory=list)
    """Rows computed at each layer."""
    miss_reasons: dict[str, int] = field(default_factory=dict)
    """Why declared chunks became holes: "not_stored" (never saved), or the store's miss reason
    ("absent" after indexing, "corrupt", "truncated", "foreign_model", "shape_mismatch", "io_error",
    "length_mismatch")."""

    def to_dict(self) -> dict:
        return asdict(self)


class FusionEngine:
    """Looks up declared chunks, fuses, and saves holes as new entries.

    Args:
        adapter: the model.
        store: where chunk caches live (read, and written for holes and precompute).
        key_context: model fingerprint, KV dtype, TP layout and config hash for chunk keys.
        config: selector, ratio and fusor settings.
        clock: time source for blend_time_s (injectable so tests never depend on wall time).
    """

    def __init__(self, adapter: ModelAdapter, store: KVStore, key_context: KeyContext,
                 config: CacheFuseConfig, clock: Callable[[], float] = time.perf_counter) -> None:
        self.adapter, self.store, self.key_context, self.config = adapter, store, key_context, config
        self.fusor = Fusor(adapter, block_rows=config.attention_block_rows)
        self.fusor.clock = clock
        self.fusor.collect_attention_stats = config.gathers_attention_stats
        self.clock = clock

    def fusor_full_layers(self, selector: str) -> int:
        """How many leading layers `selector` computes in full on this model."""
        return make_selector(selector, self.config).num_full_layers(self.adapter.shape.num_layers)

    def key(self, token_ids: Sequence[int]) -> str:
        return chunk_key(token_ids, self.key_context)

    # ------------------------------------------------------------------ precompute

    def compute_chunk(self, chunk_ids: Sequence[int], prefix_ids: Sequence[int] = ()) -> ChunkKV:
        """A chunk's RoPE-stripped K/V computed after `prefix_ids` alone (full prefill)."""
        ids = torch.tensor([*prefix_ids, *chunk_ids], dtype=torch.int64)
        segments = [Segment(len(prefix_ids), len(chunk_ids), is_chunk=True, is_system=not prefix_ids)]
        if prefix_ids:
            segments.insert(0, Segment(0, len(prefix_ids), is_chunk=False, is_system=False))
        result = self.fusor.fuse(FuseRequest(ids, segments, {}, 1.0), FullPrefillSelector())
        return extract_chunk_kv(result, segments[-1], self.adapter.rope_spec, meta={"variant": "base"})

    def precompute(self, chunks: Sequence[Sequence[int]], prefix_ids: Sequence[int] = ()) -> list[str]:
        """Stores each chunk's base variant (computed after `prefix_ids`, e.g. the system prompt)."""
        keys = []
        for chunk_ids in chunks:
            key = self.key(chunk_ids)
            if not self.store.contains(key):
                self.store.put(key, self.compute_chunk(chunk_ids, prefix_ids))
            keys.append(key)
        return keys

    # ------------------------------------------------------------------ fused prefill

    def prefill(self, token_ids: Sequence[int], chunks: Sequence[Sequence[int]], *,
                selector: str | Selector | None = None, ratio: float | None = None,
                save_holes: bool = True, preload_depth: int | None = None) -> tuple[FuseResult, FusionStats]:
        """Fuses one prompt whose declared chunks are `chunks` ([start, end) offsets).

        `selector` is a registry name (built from the config) or a ready Selector instance;
        `preload_depth` overrides the config's (the loading controller's L_p for this request).
        """
        selector = selector or self.config.selector
        selector_obj = make_selector(selector, self.config) if isinstance(selector, str) else selector
        selector_name = selector_obj.name
        ratio = self.config.recompute_ratio if ratio is None else ratio
        ids = torch.tensor(list(token_ids), dtype=torch.int64)
        segments = segment_prompt(len(token_ids), chunks)
        keys = {i: self.key(token_ids[s.start:s.end]) for i, s in enumerate(segments) if s.is_chunk}
        start = self.clock()
        load_seconds, load_bytes = Counter(), Counter()
        with self.store.pinned(list(keys.values())):
            result, loaded, miss_reasons, bytes_loaded = self._fuse(ids, segments, keys, ratio, selector_obj,
                                                                    load_seconds, load_bytes, preload_depth)
        blend_time = self.clock() - start
        saved_keys, save_failures = self._save_holes(result, segments, keys) if save_holes else ((), 0)
        last = result.rows_per_layer[-1]
        num_recomputed = len(ids) if last is None else last.numel()
        num_loaded = sum(segments[i].length for i in loaded)
        stats = FusionStats(
            selector=selector_name, recompute_ratio=ratio, chunks_hit=len(loaded),
            chunks_missed=len(keys) - len(loaded),
            tokens_reused=num_loaded - (num_loaded if last is None else int(_loaded_rows_in(last, segments, loaded))),
            tokens_recomputed=num_recomputed, num_selected=result.num_selected, num_forced=result.num_forced,
            bytes_loaded=bytes_loaded, blend_time_s=blend_time,
            holes_saved=len(saved_keys), saved_keys=saved_keys, save_failures=save_failures,
            miss_reasons=dict(miss_reasons), load_seconds_by_tier=dict(load_seconds),
            load_bytes_by_tier=dict(load_bytes), layer_seconds=list(result.layer_seconds),
            layer_rows=[len(ids) if rows is None else rows.numel() for rows in result.rows_per_layer])
        return result, stats

    def _fuse(self, ids: torch.Tensor, segments: list[Segment], keys: dict[int, str], ratio: float,
              selector: Selector, load_seconds: Counter, load_bytes: Counter, depth: int | None = None
              ) -> tuple[FuseResult, dict[int, ChunkKV] | dict[int, str], Counter, int]:
        """One blend pass: entries read whole first (preload_depth 0) or fetched layer by layer.

        A pipelined pass whose fetch misses mid-pass (LayerUnavailable) cannot turn the layers already
        computed into a hole, so it is dropped: the miss is counted under its reason and the pass re-runs
        serially with that key's segments as holes (the output equals a store without that chunk).

        Returns:
            the result, the loaded segments (index -> entry or key), misses by reason, bytes loaded.
        """
        depth = self.config.preload_depth if depth is None else depth
        depth = DEFAULT_PRELOAD_DEPTH if depth is None else depth
        if depth == 0:
            loaded, miss_reasons = self._load(segments, keys, load_seconds, load_bytes)
            result = self.fusor.fuse(FuseRequest(ids, segments, loaded, ratio), selector)
            return result, loaded, miss_reasons, sum(entry.nbytes for entry in loaded.values())
        miss_reasons = Counter()
        fetched = {}
        for index, key in keys.items():
            if self.store.contains(key):
                fetched[index] = key
            else:
                miss_reasons["not_stored"] += 1
        fetch = self._timed(store_layer_fetcher(self.store, dict.fromkeys(fetched.values())),
                            load_seconds, load_bytes)
        request = FuseRequest(ids, segments, {}, ratio, fetch_layer=fetch, fetched=fetched,
                              preload_depth=depth)
        try:
            return self.fusor.fuse(request, selector), fetched, miss_reasons, sum(load_bytes.values())
        except LayerUnavailable as exc:
            logger.warning("chunk %s missed at layer %d mid-pass (%s): re-running the pass with it as a hole",
                           exc.key, exc.layer, exc.reason)
            missed = exc
        load_seconds.clear()
        load_bytes.clear()
        reasons = Counter({missed.reason: sum(1 for key in keys.values() if key == missed.key)})
        rest = {index: key for index, key in keys.items() if key != missed.key}
        loaded, more = self._load(segments, rest, load_seconds, load_bytes)
        result = self.fusor.fuse(FuseRequest(ids, segments, loaded, ratio), selector)
        return result, loaded, reasons + more, sum(entry.nbytes for entry in loaded.values())

    def _timed(self, fetch: FetchLayer, load_seconds: Counter, load_bytes: Counter) -> FetchLayer:
        """`fetch`, recording time and bytes by serving tier (on the loader thread; read after the pass)."""
        def timed_fetch(layer: int) -> LayerKV:
            start = self.clock()
            out = fetch(layer)
            tier = self._serving_tier()
            load_seconds[tier] += self.clock() - start
            load_bytes[tier] += sum(k.nbytes + v.nbytes for k, v in out.values())
            return out
        return timed_fetch

    def _serving_tier(self) -> str:
        """The tier that served the store's last read (a tiered store says which), for load figures."""
        return getattr(self.store, "last_hit_tier", None) or getattr(self.store, "name", "store")

    def _load(self, segments: list[Segment], keys: dict[int, str], load_seconds: Counter,
              load_bytes: Counter) -> tuple[dict[int, ChunkKV], Counter]:
        """Reads every declared chunk; records misses by reason and read time and bytes by tier."""
        loaded, miss_reasons = {}, Counter()
        for index, key in keys.items():
            seg = segments[index]
            if not self.store.contains(key):
                miss_reasons["not_stored"] += 1
                continue
            before = dict(self.store.stats.misses)
            start = self.clock()
            entry = self.store.get(key)
            if entry is None:
                after = self.store.stats.misses
                new = [r for r in after if after[r] > before.get(r, 0) and r != "absent"]
                miss_reasons[new[0] if new else "absent"] += 1
                continue
            tier = self._serving_tier()
            load_seconds[tier] += self.clock() - start
            load_bytes[tier] += entry.nbytes
            if entry.num_tokens != seg.length or entry.num_layers != self.adapter.shape.num_layers:
                logger.warning("chunk %s: stored entry has %d tokens x %d layers, prompt needs %d x %d; "
                               "computing it as a hole", key, entry.num_tokens, entry.num_layers,
                               seg.length, self.adapter.shape.num_layers)
                miss_reasons["length_mismatch"] += 1
                continue
            loaded[index] = entry
        return loaded, miss_reasons

    def _save_holes(self, result: FuseResult, segments: list[Segment],
                    keys: dict[int, str]) -> tuple[tuple[str, ...], int]:
        saved, failures = [], 0
        for index in result.hole_segments:
            key = keys[index]
            if self.store.contains(key):
                continue
            prefix_ids = [i for i in sorted(keys) if i < index and not segments[i].is_system]
            meta = {"variant": "fused", "prefix": ",".join(keys[i] for i in prefix_ids)}
            if index in result.hole_token_mass:
                meta["attention"] = _attention_meta(result.hole_token_mass[index], index, prefix_ids, keys, segments)
            entry = extract_chunk_kv(result, segments[index], self.adapter.rope_spec, meta=meta)
            if self.store.put(key, entry):
                saved.append(key)
            else:
                failures += 1
        return tuple(saved), failures


def _attention_meta(token_mass: list[list[float]], index: int, prefix_ids: list[int],
                    keys: dict[int, str], segments: list[Segment]) -> str:
    """The variant's Cache-Craft statistics as JSON, in cachefuse.meta.Variant's terms: inter-attention
    to each prefix chunk (declared, non-system, before it), intra-attention, the token counts, and the
    chunk's token offsets ranked by the inter-attention each pays to the prefix (recompute candidates,
    most contextualised first; ties by offset)."""
    mass = [sum(column) for column in zip(*token_mass, strict=True)]  # [segment], summed over tokens
    from_prefix = [sum(row[i] for i in prefix_ids) for row in token_mass]
    ranked = sorted(range(len(from_prefix)), key=lambda t: (-from_prefix[t], t))
    return json.dumps({
        "inter": {keys[i]: mass[i] for i in prefix_ids}, "intra": mass[index],
        "num_tokens": segments[index].length, "prefix_num_tokens": {keys[i]: segments[i].length for i in prefix_ids},
        "ranked_tokens": ranked})


def _loaded_rows_in(rows: torch.Tensor, segments: list[Segment],
                    loaded: dict[int, ChunkKV] | dict[int, str]) -> int:
    """How many of `rows` fall inside loaded segments."""
    count = 0
    for index in loaded:
        seg = segments[index]
        count += int(((rows >= seg.start) & (rows < seg.end)).sum())
    return count

"""FusionStats: one fused prefill's figures, by the names the vLLM connector reports in a response's
`kv_transfer_params["cachefuse"]` and the loading controller learns from.

Imports `cachefuse.metadata.base` (the saved variants' records); never vllm, and no torch on import (a
pass's tensors are only read through their methods). `pass_stats` turns one pass into its figures.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from cachefuse.metadata.base import VariantRecord, record_to_dict

if TYPE_CHECKING:
    import torch

    from cachefuse.chunks import Segment
    from cachefuse.fusion.plan import FuseResult
    from cachefuse.fusion.saving import SaveReport
    from cachefuse.loading.entries import LoadFigures
    from cachefuse.metadata.index import VariantChoice


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
    """Holes stored as variants by this request (queued for writing, when saved in the background)."""
    saved_keys: tuple[str, ...] = ()
    """Chunk keys stored by this request (holes)."""
    loaded_keys: tuple[str, ...] = ()
    """Store keys of the entries this request read: a chunk's own key, or its variant's (the keys a
    tier placement must count, not the chunks' plain keys)."""
    save_failures: int = 0
    """Holes the store refused (full of pinned entries, unwritable directory, ...); saved in the
    background, a refusal comes later, in `FusionEngine.take_save_report`."""
    saves_skipped: int = 0
    """Holes not saved because the background saver's queue was full."""
    load_seconds_by_tier: dict[str, float] = field(default_factory=dict)
    """Time spent reading chunk entries, by the tier that served them (measured figures)."""
    load_bytes_by_tier: dict[str, int] = field(default_factory=dict)
    """Bytes read, by serving tier."""
    layer_seconds: list[float] = field(default_factory=list)
    """Blend-pass time of each layer (the compute figures' samples)."""
    layer_rows: list[int] = field(default_factory=list)
    """Rows computed at each layer."""
    chunk_cfo: list[float | None] = field(default_factory=list)
    """Per declared chunk, the CFO of the variant it reused (None: computed in full)."""
    chunks_loaded: list[bool] = field(default_factory=list)
    """Per declared chunk, whether its K/V were loaded (False: computed in full, planned so or missed). A
    blend replayed after a preemption reloads exactly these."""
    saved_variants: tuple[VariantRecord, ...] = ()
    """Metadata of the variants this request stored (the scheduler's index learns them)."""
    evicted_variants: tuple[str, ...] = ()
    """Variant ids this request evicted (the N x M budget) to admit its holes."""
    probe_time_s: float = 0.0
    """Time of the question probe inside `blend_time_s` (fusionrag, qcfuse: the extra pass), else 0."""
    probe_layers: int = 0
    """Layers the question probe ran (0: the selector runs none)."""
    probe_rows: int = 0
    """Rows the probe computed at each of its layers (holes, undeclared tokens, question, last token)."""
    exact_prefix_chunks: int = 0
    """Declared non-system chunks loaded from a variant computed after exactly the tokens before them
    (VariantChoice.exact): no row of theirs was a candidate, the ratio went to the others."""
    exact_prefix_tokens: int = 0
    """Their tokens."""
    miss_reasons: dict[str, int] = field(default_factory=dict)
    """Why declared chunks became holes: "not_stored" (never saved), or the store's miss reason
    ("absent" after indexing, "corrupt", "truncated", "foreign_model", "shape_mismatch", "io_error",
    "length_mismatch")."""

    def to_dict(self) -> dict:
        data = asdict(self)
        data["saved_variants"] = [record_to_dict(r) for r in self.saved_variants]
        return data


@dataclass
class PassLoads:
    """What one pass loaded, and what it missed: the engine's side of `pass_stats`."""

    loaded: dict[int, Any]
    """Segment index -> the entry (or key) loaded for it."""
    load_keys: dict[int, str]
    """Segment index -> the store key it was to load (its chosen variant's)."""
    choices: list[VariantChoice | None]
    """Per declared chunk, the variant chosen (None: computed in full)."""
    figures: LoadFigures
    miss_reasons: Counter
    bytes_loaded: int


def pass_stats(selector: str, ratio: float, segments: Sequence[Segment], chunk_indices: list[int],
               result: FuseResult, loads: PassLoads, saved: SaveReport, blend_time_s: float) -> FusionStats:
    """One pass's figures: what it reused, recomputed, loaded, missed and saved."""
    num_tokens, loaded = segments[-1].end, loads.loaded
    last = result.rows_per_layer[-1]
    num_loaded = sum(segments[i].length for i in loaded)
    exact = [i for i, c in zip(chunk_indices, loads.choices, strict=True) if c is not None and c.exact and i in loaded]
    return FusionStats(
        selector=selector, recompute_ratio=ratio, chunks_hit=len(loaded), chunks_missed=len(chunk_indices) - len(loaded),
        tokens_reused=num_loaded - (num_loaded if last is None else _loaded_rows_in(last, segments, loaded)),
        tokens_recomputed=num_tokens if last is None else last.numel(), num_selected=result.num_selected,
        num_forced=result.num_forced, bytes_loaded=loads.bytes_loaded, blend_time_s=blend_time_s,
        holes_saved=len(saved.saved_keys), saved_keys=tuple(saved.saved_keys), save_failures=saved.failures,
        loaded_keys=tuple(loads.load_keys[i] for i in loaded), saves_skipped=saved.skipped,
        miss_reasons=dict(+loads.miss_reasons), load_seconds_by_tier=dict(loads.figures.seconds),
        load_bytes_by_tier=dict(loads.figures.bytes), layer_seconds=list(result.layer_seconds),
        layer_rows=[num_tokens if rows is None else rows.numel() for rows in result.rows_per_layer],
        chunk_cfo=[None if c is None else c.cfo for c in loads.choices],
        chunks_loaded=[i in loaded for i in chunk_indices],
        saved_variants=tuple(saved.records), evicted_variants=tuple(saved.evicted),
        probe_time_s=result.probe_seconds, probe_layers=result.probe_layers, probe_rows=result.probe_rows,
        exact_prefix_chunks=len(exact), exact_prefix_tokens=sum(segments[i].length for i in exact))


def _loaded_rows_in(rows: torch.Tensor, segments: Sequence[Segment], loaded: dict[int, Any]) -> int:
    """How many of `rows` fall inside loaded segments."""
    rows = rows.cpu()  # one read from the device, not one sync per loaded segment
    count = 0
    for index in loaded:
        seg = segments[index]
        count += int(((rows >= seg.start) & (rows < seg.end)).sum())
    return count

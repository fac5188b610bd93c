"""FusionStats: one fused prefill's figures, by the names the vLLM connector reports in a response's
`kv_transfer_params["cachefuse"]` and the loading controller learns from.

Imports `cachefuse.metadata.base` (the saved variants' records); no torch, never vllm.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from cachefuse.metadata.base import VariantRecord, record_to_dict


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
    miss_reasons: dict[str, int] = field(default_factory=dict)
    """Why declared chunks became holes: "not_stored" (never saved), or the store's miss reason
    ("absent" after indexing, "corrupt", "truncated", "foreign_model", "shape_mismatch", "io_error",
    "length_mismatch")."""

    def to_dict(self) -> dict:
        data = asdict(self)
        data["saved_variants"] = [record_to_dict(r) for r in self.saved_variants]
        return data

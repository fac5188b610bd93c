"""The loading controller's decision per request, and the model's K/V geometry it prices loads with.

Imports cachefuse.loading (controller, figures) and cachefuse.chunks; no vllm, and no torch at import:
selectors (cachefuse.select, whose modules import torch) are built by `make_selector` inside `decide`,
only when the controller has measured figures to decide with. The geometry reads the model's config
and a table of dtype sizes, never a tensor. The controller itself is cachefuse.loading.controller
(docs/loading.md); this module gathers its inputs and keeps the re-measure clocks (per tier, and the
blend's compute).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from cachefuse.chunks import dtype_name, is_candidate_chunk
from cachefuse.config import CacheFuseConfig
from cachefuse.errors import ConfigError
from cachefuse.loading import controller
from cachefuse.loading.figures import FIGURE_STALE_S, ComputeFigures, TierFigures, blend_cost_model
from cachefuse.request import FusionRequest

if TYPE_CHECKING:
    from cachefuse.metadata.index import VariantChoice

DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1,
               "float8_e5m2": 1, "float8_e5m2fnuz": 1, "int8": 1, "uint8": 1}
"""Bytes per element of the dtypes a model's K/V are stored in, by `chunks.dtype_name`."""

VERDICTS = (*controller.VERDICTS, "remeasure", "save_holes", "no_figures")
"""A decision's `verdict` as the gate hands it out: the controller's, or `remeasure` (a no-go lasting
FIGURE_STALE_S fused anyway to measure its tier, or the blend's compute, again), `save_holes` (a no-go fused anyway because it has declared chunks
not stored, which only a blend saves), or `no_figures` (nothing measured yet: the request's own ratio)."""


BLEND_COMPUTE = "blend compute"
"""`Gate.no_go_since`'s key for recompute-bound no-gos (the tiers' keys are their names)."""


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a torch dtype (or its name), without torch.

    Raises:
        ConfigError: a dtype the table does not know, named with the ones it does.
    """
    name = dtype_name(dtype)
    if name not in DTYPE_BYTES:
        raise ConfigError(f"model dtype {name!r}: its size per element is unknown to the scheduler's "
                          f"controller; expected one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def kv_geometry(hf_text_config: Any, dtype: Any, tp_size: int) -> tuple[int, int]:
    """(layers, stored K/V bytes per token over all layers, this rank's heads) of a model.

    Args:
        hf_text_config: the model's transformers text config (`num_hidden_layers`, `hidden_size`,
            `num_attention_heads`, `num_key_value_heads`, optional `head_dim`).
        dtype: the model's dtype (torch dtype or its name).
        tp_size: tensor-parallel size: each rank stores its share of the K/V heads (at least one).
    """
    hf = hf_text_config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_heads = max(1, hf.num_key_value_heads // tp_size)
    return hf.num_hidden_layers, 2 * kv_heads * head_dim * dtype_bytes(dtype) * hf.num_hidden_layers


class Gate:
    """Go/no-go and ratio per request (`decide`), and the clock that re-measures a tier held at no-go.

    `figures` are the worker's latest measured figures (tiers' bytes/s, blend and prefill speed), set by
    the hooks when the worker reports them.
    """

    def __init__(self, config: CacheFuseConfig, model_config: Any, tp_size: int) -> None:
        self.config = config
        self._model_config = model_config
        self._tp_size = tp_size
        self.figures: dict[str, Any] = {}
        """The worker's latest measured figures (tiers' bytes/s, blend and prefill speed)."""
        self.clock: Callable[[], float] = time.monotonic
        self.no_go_since: dict[str, float] = {}
        """Per tier, since when the controller has turned down requests whose load it bounds (and fused
        none of them), and under BLEND_COMPUTE since when it has turned down recompute-bound ones: a figure
        only changes when a blend runs, so after FIGURE_STALE_S of that, one request is fused anyway to
        measure it again."""
        self.remeasuring: dict[str, dict[str, Any]] = {}
        """The forced decision of a request picked to re-measure, kept until the request finishes, so
        vLLM asking again (no free blocks yet) gets the same answer."""

    def blend_figures(self) -> ComputeFigures | None:
        """The worker's measured blend cost model (what the step budget prices passes by), or None while
        no blend layer has been timed."""
        return blend_cost_model(self.figures)

    def kv_geometry(self) -> tuple[int, int]:
        """(layers, stored K/V bytes per token over all layers, this rank's heads)."""
        return kv_geometry(self._model_config.hf_text_config, self._model_config.dtype, self._tp_size)

    def forget(self, req_id: str) -> None:
        """The request finished: its forced decision, if any, goes."""
        self.remeasuring.pop(req_id, None)

    def decide(self, req_id: str, fusion: FusionRequest, num_tokens: int,
               variants: Sequence[VariantChoice | None], cached_prefix: int = 0) -> dict[str, Any]:
        """The loading controller's choice for one request, from the worker's measured figures: each
        chunk's load priced at the tiers the index knows hold it, rows as the selector will pick them,
        plain vLLM's prefill past the `cached_prefix` tokens its own prefix cache holds."""
        from cachefuse.select.base import PlannedChunk  # torch: only once there are figures to decide with
        from cachefuse.select.registry import make_selector

        figures = self.figures
        samples = figures.get("samples", {})
        if not figures.get("tiers") or not samples.get("blend_layers") or not samples.get("prefill_steps"):
            return {"fuse": True, "verdict": "no_figures", "ratio": fusion.recompute_ratio,
                    "reason": "no measured figures yet (tier bandwidth, blend and prefill speed): fixed ratio"}
        num_layers, bytes_per_token = self.kv_geometry()
        # (tokens, its rows candidates, choice) of each loaded chunk; the system chunk is the one at offset 0
        loaded = [(e - s, is_candidate_chunk(s == 0, c.exact), c)
                  for (s, e), c in zip(fusion.chunks, variants, strict=True) if c is not None]
        loaded_tokens = sum(n for n, _, _ in loaded)
        tiers = [TierFigures(name, bps) for name, bps in figures["tiers"].items()]
        selector = make_selector(fusion.selector, self.config)
        rows = selector.estimate_rows([PlannedChunk(n, c.cfo) for n, candidate, c in loaded if candidate],
                                      num_layers)
        probe = selector.probe_spec(num_layers)
        shape = controller.RequestShape(
            num_tokens=num_tokens, num_layers=num_layers, num_full_layers=selector.num_full_layers(num_layers),
            num_candidates=sum(n for n, candidate, _ in loaded if candidate), num_forced=num_tokens - loaded_tokens,
            bytes_to_load=loaded_tokens * bytes_per_token,
            bytes_by_tier=controller.tier_bytes([(n * bytes_per_token, c.tiers) for n, _, c in loaded], tiers),
            num_planned_rows=rows.num_planned_rows, num_ratio_candidates=rows.num_ratio_candidates,
            num_probe_layers=0 if probe is None else probe.depth, num_prefix_cached=cached_prefix)
        decision = controller.decide(shape, ComputeFigures(**figures["compute"]), tiers, r_min=fusion.recompute_ratio,
                                      r_max=max(self.config.max_recompute_ratio, fusion.recompute_ratio),
                                      ratio_mode="controller", fixed_ratio=fusion.recompute_ratio,
                                      force_fuse=self.config.force_fuse, margin=self.config.controller_margin)
        holes = [e - s for (s, e), choice in zip(fusion.chunks, variants, strict=True) if choice is None]
        if not decision.fuse and holes and self.config.save_holes:
            return self._save_holes(decision, holes)
        return self._remeasure(req_id, decision)

    def _save_holes(self, decision: controller.Decision, holes: Sequence[int]) -> dict[str, Any]:
        """A no-go fused anyway because some declared chunks are not stored (holes): only a blend saves a
        hole, so plain vLLM would leave them unstored, and every later request with them would price them
        as computed in full and be turned down again; the cache would never fill from served requests.
        The estimate counts a hole's rows as computed, so mostly-new prompts are the ones turned down."""
        out = dataclasses.asdict(decision)
        self._measured(decision.tier)
        out.update(fuse=True, verdict="save_holes",
                   reason=f"save holes: {len(holes)} declared chunk(s) of {sum(holes)} tokens not stored, which "
                          f"plain vLLM would not save: fused anyway; {decision.reason}")
        return out

    def _remeasure(self, req_id: str, decision: controller.Decision) -> dict[str, Any]:
        """The decision, or, for a no-go that has lasted FIGURE_STALE_S, a go for this one request. Only
        blends update the figures a no-go rests on, so one bad figure kept every request at no-go for good:
        a slow first read of a tier (the figure is seeded by it), or blend compute measured slow (a busy
        machine, a pass paying one-time costs). A load-bound no-go waits per tier (the bottleneck tier), a
        recompute-bound one on the blend's compute (BLEND_COMPUTE). The worker replaces figures that old
        with this request's (BandwidthMeter, FigureRecorder.observe_blend), rather than averaging."""
        if req_id in self.remeasuring:
            return self.remeasuring[req_id]
        out = dataclasses.asdict(decision)
        if decision.fuse:
            self._measured(decision.tier)
            return out
        load_bound = decision.tier is not None and decision.est_load_s >= decision.est_recompute_s
        what = decision.tier if load_bound else BLEND_COMPUTE
        now = self.clock()
        since = self.no_go_since.setdefault(what, now)
        if now - since >= FIGURE_STALE_S:
            self._measured(decision.tier)
            self.no_go_since[what] = now  # the next re-measure of it is due FIGURE_STALE_S from this one
            figure = f"load-bound no-go on {what}" if load_bound else "recompute-bound no-go"
            out.update(fuse=True, verdict="remeasure",
                       reason=f"re-measure ({figure} for {FIGURE_STALE_S:g} s, its figures unmeasured since): "
                              f"fused anyway; {decision.reason}")
            self.remeasuring[req_id] = out
        return out

    def _measured(self, tier: str | None) -> None:
        """A blend runs: it measures the blend's compute and reads `tier`; their no-go clocks start over."""
        self.no_go_since.pop(BLEND_COMPUTE, None)
        if tier is not None:
            self.no_go_since.pop(tier, None)

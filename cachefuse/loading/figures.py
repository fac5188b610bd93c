"""FigureRecorder: what the worker measures for the loading controller, from real work only.

Imports cachefuse.controller (the math) and nothing heavier. The worker feeds it every blend pass
(bytes and seconds of each load by serving tier; seconds and rows of each layer) and every step
that was nothing but plain vLLM prefills (tokens, seconds). `snapshot()` is the plain dict that
travels to the scheduler in the connector's worker metadata, where decisions are made.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

from cachefuse.controller import BandwidthMeter, ComputeFigures, fit_compute_figures, fit_prefill

MAX_SAMPLES = 256


class FigureRecorder:
    def __init__(self, min_load_bytes: int = 1 << 20, alpha: float = 0.2) -> None:
        self.bandwidth = BandwidthMeter(alpha=alpha, min_bytes=min_load_bytes)
        self.blend_samples: deque[tuple[float, float, float]] = deque(maxlen=MAX_SAMPLES)
        self.prefill_samples: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self.changed = False

    def observe_blend(self, stats: Any, num_tokens: int) -> None:
        """One blend pass: FusionStats' loads by tier and its per-layer (rows, seconds)."""
        for tier, seconds in stats.load_seconds_by_tier.items():
            self.bandwidth.observe(tier, stats.load_bytes_by_tier.get(tier, 0), seconds)
        for rows, seconds in zip(stats.layer_rows, stats.layer_seconds, strict=True):
            self.blend_samples.append((float(rows), float(num_tokens), float(seconds)))
        self.changed = True

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step of vLLM's own (unfused) prefills: its tokens and wall time."""
        if num_tokens > 0 and seconds > 0:
            self.prefill_samples.append((float(num_tokens), float(seconds)))
            self.changed = True

    def compute_figures(self) -> ComputeFigures:
        figures = fit_prefill(list(self.prefill_samples)) if self.prefill_samples else ComputeFigures()
        if self.blend_samples:
            figures = fit_compute_figures(list(self.blend_samples), base=figures)
        return figures

    def snapshot(self) -> dict[str, Any]:
        """Serializable figures: tiers' bytes/s, the compute model and how many samples back it."""
        tiers = {name: self.bandwidth.bytes_per_s(name) for name in self.bandwidth.tiers()}
        return {"tiers": {k: v for k, v in tiers.items() if v is not None},
                "compute": dataclasses.asdict(self.compute_figures()),
                "samples": {"blend_layers": len(self.blend_samples), "prefill_steps": len(self.prefill_samples)}}

"""Aggregate connector figures: vLLM's periodic stats log and Prometheus (`/metrics` when serving).

Workers and the scheduler each record counters into a CacheFuseConnectorStats per interval; vLLM
sums them (`aggregate`), logs `reduce()`, and hands the data to CacheFusePromMetrics.observe, which
adds them to Prometheus counters named `vllm:cachefuse_*` (fallbacks labelled by reason).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

# stats key -> (Prometheus counter name, help text)
COUNTERS = {
    "requests_fused": ("vllm:cachefuse_requests_fused", "Requests whose prefill cachefuse fused."),
    "chunks_hit": ("vllm:cachefuse_chunks_hit", "Declared chunks loaded from the store."),
    "chunks_missed": ("vllm:cachefuse_chunks_missed", "Declared chunks computed in full (holes)."),
    "tokens_reused": ("vllm:cachefuse_tokens_reused", "Prompt tokens whose K/V were reused as loaded."),
    "tokens_recomputed": ("vllm:cachefuse_tokens_recomputed", "Prompt rows recomputed by the blend pass."),
    "bytes_loaded": ("vllm:cachefuse_bytes_loaded", "Bytes of chunk K/V loaded from the store."),
    "blend_time_s": ("vllm:cachefuse_blend_seconds", "Time from each blend's start to its end, summed: a "
                     "split blend's includes the steps it waited between its layers, a batched one's its batch's."),
    "holes_saved": ("vllm:cachefuse_holes_saved", "Holes stored as variants (queued, when saved in the background)."),
    "saves_skipped": ("vllm:cachefuse_saves_skipped", "Holes not saved: the background writer's queue was full."),
    "save_failures": ("vllm:cachefuse_save_failures", "Holes the store or metadata store refused."),
    "blend_steps": ("vllm:cachefuse_blend_steps", "Engine steps the blends ran in, summed over blends "
                    "(divided by requests_fused: steps per blend; above 1, blends split by blend_step_tokens)."),
    "blend_batch_size": ("vllm:cachefuse_blend_batch_size", "Blends each blend ran batched with (itself "
                         "included), summed over blends (divided by requests_fused: the mean batch)."),
    "blends_split": ("vllm:cachefuse_blends_split", "Blends that ran across more than one engine step."),
    "blends_batched": ("vllm:cachefuse_blends_batched", "Blends that ran batched with at least one other."),
}
FALLBACK_PREFIX = "fallback_"


@dataclass
class CacheFuseConnectorStats(KVConnectorStats):
    """Counters summed over workers and steps: requests fused, fallbacks by reason, tokens, bytes, time."""

    def reset(self) -> None:
        self.data = {}

    def record(self, **counts: float) -> None:
        for name, value in counts.items():
            self.data[name] = self.data.get(name, 0) + value

    def aggregate(self, other: KVConnectorStats) -> CacheFuseConnectorStats:
        total = Counter(self.data)
        total.update(other.data)
        return CacheFuseConnectorStats(dict(total))

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data


class CacheFusePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            key: create_metric_per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                                          per_engine_labelvalues)
            for key, (name, doc) in COUNTERS.items()}
        self.fallbacks = self._counter_cls(
            name="vllm:cachefuse_requests_fallback", labelnames=[*labelnames, "reason"],
            documentation="Requests that ran as plain vLLM, by reason.")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in self.counters and value:
                self.counters[key][engine_idx].inc(value)
            elif key.startswith(FALLBACK_PREFIX) and value:
                labels = self.per_engine_labelvalues[engine_idx]
                self.fallbacks.labels(*labels, key.removeprefix(FALLBACK_PREFIX)).inc(value)

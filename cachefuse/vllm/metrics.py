"""Aggregate connector figures: vLLM's periodic stats log and Prometheus (`/metrics` when serving).

Workers and the scheduler each record into a CacheFuseConnectorStats per step; vLLM merges a step's
(`aggregate`: the workers', then the scheduler's), hands the result to CacheFusePromMetrics.observe,
and for its log merges the steps of an interval again and logs `reduce()`. Three kinds of data travel:

- counters (a number per key): summed by `aggregate`, added to Prometheus counters `vllm:cachefuse_*`;
  keys with a label prefix (`fallback_<reason>`, `controller_<verdict>`, `bytes_loaded_tier_<tier>`,
  `load_seconds_tier_<tier>`) go to one labelled counter each.
- samples (a list per key, `samples_<name>`): concatenated, each observed into a Prometheus histogram.
- gauges (`gauge_<name>@<rank>`): a level, not an amount, so summing intervals would be wrong. Each
  worker rank reports its level under its own key when it changes; `aggregate` keeps the later report
  of a key, and the Prometheus side keeps every rank's last report and sets the gauge to their sum.
  vLLM only steps while it has requests: a level that changes while the engine idles (the save queue
  draining) shows at the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from cachefuse.vllm.scheduler_side.gate import VERDICTS

# stats key -> (Prometheus counter name, help text)
COUNTERS = {
    "requests_fused": ("vllm:cachefuse_requests_fused", "Requests whose prefill cachefuse fused."),
    "chunks_hit": ("vllm:cachefuse_chunks_hit", "Declared chunks loaded from the store."),
    "chunks_missed": ("vllm:cachefuse_chunks_missed", "Declared chunks computed in full (holes)."),
    "tokens_reused": ("vllm:cachefuse_tokens_reused", "Prompt tokens whose K/V were reused as loaded."),
    "tokens_recomputed": ("vllm:cachefuse_tokens_recomputed", "Prompt rows recomputed by the blend pass."),
    "exact_prefix_chunks": ("vllm:cachefuse_exact_prefix_chunks", "Declared chunks reused at their exact place "
                            "(after exactly the tokens they were computed after): no row of theirs recomputed."),
    "exact_prefix_tokens": ("vllm:cachefuse_exact_prefix_tokens", "Tokens of the chunks reused at their exact place."),
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
    "saves_written": ("vllm:cachefuse_saves_written", "Holes the background writer finished writing (counted "
                      "by rank 0, as holes_saved: saved minus written minus failed is what waits)."),
}
FALLBACK_PREFIX = "fallback_"
LABELLED = {  # key prefix -> (Prometheus counter name, label, help text)
    FALLBACK_PREFIX: ("vllm:cachefuse_requests_fallback", "reason", "Requests that ran as plain vLLM, by reason."),
    "controller_": ("vllm:cachefuse_controller_decisions", "verdict",
                    "The loading controller's decision per finished request (ratio_mode: controller): go, "
                    "no_go, force_fuse, remeasure (a no-go fused to measure its tier or the blend's compute again), "
                    "save_holes (a no-go fused to save its chunks not stored), no_figures (nothing measured yet)."),
    "bytes_loaded_tier_": ("vllm:cachefuse_bytes_loaded_by_tier", "tier",
                           "Bytes of chunk K/V read, by the store tier that served them (summed over ranks)."),
    "load_seconds_tier_": ("vllm:cachefuse_load_seconds_by_tier", "tier",
                           "Time spent reading chunk K/V, by serving tier (with bytes_loaded_by_tier: the "
                           "bandwidth each tier delivers)."),
}
SAMPLES_PREFIX = "samples_"
HISTOGRAMS = {  # sample name -> (Prometheus histogram name, help text, buckets)
    "blend_time_s": ("vllm:cachefuse_blend_time_seconds", "Each blend's time from start to end (as "
                     "blend_seconds, one observation per blend).",
                     (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)),
    "recompute_ratio": ("vllm:cachefuse_recompute_ratio", "The recompute ratio of each fused request (the "
                        "controller's choice in ratio_mode: controller, else the configured or requested one).",
                        (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)),
}
GAUGE_PREFIX = "gauge_"
GAUGES = {  # gauge name -> (Prometheus gauge name, help text)
    "save_queue_bytes": ("vllm:cachefuse_save_queue_bytes", "Bytes of hole K/V queued for the background "
                         "writer, summed over ranks, as of the engine's last step."),
    "save_queue_holes": ("vllm:cachefuse_save_queue_holes", "Holes queued for (or being written by) the "
                         "background writer, summed over ranks, as of the engine's last step."),
    "save_queue_capacity_bytes": ("vllm:cachefuse_save_queue_capacity_bytes", "The background writer's "
                                  "queue bound (save_queue_bytes), summed over ranks: beyond it holes are skipped."),
}


@dataclass
class CacheFuseConnectorStats(KVConnectorStats):
    """One step's (or interval's) figures from the workers and the scheduler: counters, samples and
    gauges (the module docstring says how each merges)."""

    def reset(self) -> None:
        self.data = {}

    def record(self, **counts: float) -> None:
        """Adds to counters (a key with a label prefix counts under that label)."""
        for name, value in counts.items():
            self.data[name] = self.data.get(name, 0) + value

    def sample(self, **values: float) -> None:
        """One observation of each named histogram (HISTOGRAMS)."""
        for name, value in values.items():
            self.data.setdefault(SAMPLES_PREFIX + name, []).append(value)

    def set_gauges(self, rank: int, **levels: float) -> None:
        """The levels of named gauges (GAUGES) on worker `rank`, replacing what it said before."""
        for name, value in levels.items():
            self.data[f"{GAUGE_PREFIX}{name}@{rank}"] = value

    def aggregate(self, other: KVConnectorStats) -> CacheFuseConnectorStats:
        """Counters summed, samples concatenated, a gauge's later report kept (`other` is the later)."""
        data = dict(self.data)
        for key, value in other.data.items():
            if key.startswith(GAUGE_PREFIX):
                data[key] = value
            elif key.startswith(SAMPLES_PREFIX):
                data[key] = [*data.get(key, []), *value]
            else:
                data[key] = data.get(key, 0) + value
        return CacheFuseConnectorStats(data)

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's log line: counters and gauge reports as they are, each sample list as its count and mean."""
        out: dict[str, int | float] = {}
        for key, value in self.data.items():
            if key.startswith(SAMPLES_PREFIX):
                name = key.removeprefix(SAMPLES_PREFIX)
                out[f"{name}_count"] = len(value)
                out[f"{name}_mean"] = sum(value) / len(value) if value else 0.0
            else:
                out[key] = value
        return out

    def is_empty(self) -> bool:
        return not self.data


class CacheFusePromMetrics(KVConnectorPromMetrics):
    """The `vllm:cachefuse_*` metrics, labelled per engine as vLLM's own (model_name, engine)."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self.counters = {key: per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames))
                         for key, (name, doc) in COUNTERS.items()}
        self.labelled = {prefix: self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, label])
                         for prefix, (name, label, doc) in LABELLED.items()}
        for engine_labels in per_engine_labelvalues.values():  # a closed set: each verdict exported from 0
            for verdict in VERDICTS:
                self.labelled["controller_"].labels(*engine_labels, verdict)
        self.histograms = {
            key: per_engine(self._histogram_cls(name=name, documentation=doc, labelnames=labelnames,
                                                buckets=list(buckets)))
            for key, (name, doc, buckets) in HISTOGRAMS.items()}
        self.gauges = {key: per_engine(self._gauge_cls(name=name, documentation=doc, labelnames=labelnames,
                                                       multiprocess_mode="mostrecent"))
                       for key, (name, doc) in GAUGES.items()}
        self._levels: dict[tuple[int, str], dict[str, float]] = {}  # (engine, gauge) -> rank -> last level

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key.startswith(GAUGE_PREFIX):
                self._set_level(engine_idx, key.removeprefix(GAUGE_PREFIX), value)
            elif key.startswith(SAMPLES_PREFIX):
                histogram = self.histograms.get(key.removeprefix(SAMPLES_PREFIX))
                for sample in value if histogram is not None else ():
                    histogram[engine_idx].observe(sample)
            elif key in self.counters and value:
                self.counters[key][engine_idx].inc(value)
            elif value:
                self._count_labelled(engine_idx, key, value)

    def _count_labelled(self, engine_idx: int, key: str, value: float) -> None:
        for prefix, counter in self.labelled.items():
            if key.startswith(prefix):
                counter.labels(*self.per_engine_labelvalues[engine_idx], key.removeprefix(prefix)).inc(value)
                return

    def _set_level(self, engine_idx: int, key: str, value: float) -> None:
        name, _, rank = key.rpartition("@")
        if name not in self.gauges:
            return
        levels = self._levels.setdefault((engine_idx, name), {})
        levels[rank] = value
        self.gauges[name][engine_idx].set(sum(levels.values()))

"""Connector stats aggregate across workers and steps; Prometheus counters, histograms and gauges receive them.

Counters sum, samples concatenate, and a gauge (a level: the save queue) is each rank's last report, summed over
ranks: summing its reports over steps, or taking one step's ranks only, would say a level the queue never had.
"""

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cachefuse.vllm.connector import CacheFuseConnector
from cachefuse.vllm.metrics import CacheFuseConnectorStats


def test_stats_aggregate_reduce_reset():
    a, b = CacheFuseConnectorStats(), CacheFuseConnectorStats()
    a.record(requests_fused=1, tokens_recomputed=40)
    b.record(requests_fused=2, fallback_blend_error=1)
    total = a.aggregate(b)
    assert total.reduce() == {"requests_fused": 3, "tokens_recomputed": 40, "fallback_blend_error": 1}
    assert not total.is_empty()
    total.reset()
    assert total.is_empty()
    rebuilt = CacheFuseConnector.build_kv_connector_stats({"requests_fused": 3})
    assert rebuilt.reduce() == {"requests_fused": 3}


def test_samples_concatenate_and_a_gauge_keeps_each_ranks_later_report():
    step1, step2 = CacheFuseConnectorStats(), CacheFuseConnectorStats()
    step1.sample(blend_time_s=0.5)
    step1.set_gauges(0, save_queue_bytes=100)
    step1.set_gauges(1, save_queue_bytes=40)
    step2.sample(blend_time_s=0.25)
    step2.set_gauges(0, save_queue_bytes=0)
    merged = step1.aggregate(step2)
    assert merged.data == {"samples_blend_time_s": [0.5, 0.25], "gauge_save_queue_bytes@0": 0,
                           "gauge_save_queue_bytes@1": 40}
    assert merged.reduce() == {"blend_time_s_count": 2, "blend_time_s_mean": 0.375,
                               "gauge_save_queue_bytes@0": 0, "gauge_save_queue_bytes@1": 40}


def prometheus_metrics():
    """(registry, CacheFusePromMetrics of engine 0 labelled model_name="m") in a registry of its own."""
    registry = CollectorRegistry()

    def bind(cls):
        class Bound(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, registry=registry, **kwargs)
        return Bound

    types = {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=None)
    return registry, CacheFuseConnector.build_prom_metrics(vllm_config, types, ["model_name", "engine"],
                                                           {0: ["m", "0"]})


LABELS = {"model_name": "m", "engine": "0"}


def test_prometheus_counters_observe_the_stats():
    registry, metrics = prometheus_metrics()
    metrics.observe({"requests_fused": 2, "tokens_recomputed": 50, "fallback_malformed_request": 1}, 0)
    metrics.observe({"requests_fused": 1}, 0)
    labels = LABELS
    assert registry.get_sample_value("vllm:cachefuse_requests_fused_total", labels) == 3
    assert registry.get_sample_value("vllm:cachefuse_tokens_recomputed_total", labels) == 50
    assert registry.get_sample_value("vllm:cachefuse_requests_fallback_total",
                                     {**labels, "reason": "malformed_request"}) == 1


def test_labelled_counters_histograms_and_gauges():
    registry, metrics = prometheus_metrics()
    for verdict in ("go", "no_go", "force_fuse", "remeasure", "save_holes", "no_figures"):  # exported before any request
        assert registry.get_sample_value("vllm:cachefuse_controller_decisions_total", {**LABELS, "verdict": verdict}) == 0
    step = CacheFuseConnectorStats()
    step.record(controller_go=2, controller_no_go=1, bytes_loaded_tier_memory=300, bytes_loaded_tier_disk=50,
                load_seconds_tier_disk=0.5, saves_written=3)
    step.sample(recompute_ratio=0.15, blend_time_s=0.02)
    step.sample(recompute_ratio=0.4)
    step.set_gauges(0, save_queue_bytes=100, save_queue_holes=2, save_queue_capacity_bytes=1000)
    step.set_gauges(1, save_queue_bytes=60, save_queue_holes=1, save_queue_capacity_bytes=1000)
    metrics.observe(step.data, 0)
    later = CacheFuseConnectorStats()
    later.set_gauges(1, save_queue_bytes=0, save_queue_holes=0)  # rank 1 drained; rank 0 said nothing new
    metrics.observe(later.data, 0)

    def value(name, **labels):
        return registry.get_sample_value(name, {**LABELS, **labels})

    assert (value("vllm:cachefuse_controller_decisions_total", verdict="go"),
            value("vllm:cachefuse_controller_decisions_total", verdict="no_go")) == (2, 1)
    assert (value("vllm:cachefuse_bytes_loaded_by_tier_total", tier="memory"),
            value("vllm:cachefuse_bytes_loaded_by_tier_total", tier="disk"),
            value("vllm:cachefuse_load_seconds_by_tier_total", tier="disk")) == (300, 50, 0.5)
    assert value("vllm:cachefuse_saves_written_total") == 3
    assert (value("vllm:cachefuse_recompute_ratio_count"), value("vllm:cachefuse_recompute_ratio_bucket", le="0.15"),
            value("vllm:cachefuse_recompute_ratio_sum")) == (2, 1, 0.55)
    assert value("vllm:cachefuse_blend_time_seconds_count") == 1
    # rank 0's last level (100) plus rank 1's (now 0): neither the last step alone (0) nor every report (160)
    assert (value("vllm:cachefuse_save_queue_bytes"), value("vllm:cachefuse_save_queue_holes"),
            value("vllm:cachefuse_save_queue_capacity_bytes")) == (100, 2, 2000)


def test_tensor_parallel_ranks_count_a_request_once_when_vllm_sums_them():
    """vLLM sums every rank's connector stats: each rank counting a blend's chunks, tokens, time and saves
    multiplied them by the TP size (the response said half at TP=2). Bytes are each rank's own heads."""
    from cachefuse.vllm.worker_side import WorkerSide

    figures = {"tokens_reused": 2500, "tokens_recomputed": 300, "bytes_loaded": 1000, "blend_time_s": 0.04,
               "chunks_hit": 3, "chunks_missed": 1, "exact_prefix_chunks": 1, "exact_prefix_tokens": 200, "holes_saved": 1, "saves_skipped": 2, "save_failures": 1,
               "blend_steps": 3, "blend_batch_size": 2, "load_bytes_by_tier": {"disk": 600, "memory": 400},
               "load_seconds_by_tier": {"disk": 0.01, "memory": 0.001}}
    ranks = []
    for rank in (0, 1):
        side = WorkerSide.__new__(WorkerSide)  # only what _record_stats reads
        side.tp_rank, side._stats = rank, CacheFuseConnectorStats()
        side._record_stats(figures)
        ranks.append(side._stats)
    total = ranks[0].aggregate(ranks[1]).reduce()
    # the response's figures once (a split, batched blend counted once); each rank's own bytes and their time
    counted_once = {k: v for k, v in figures.items() if not k.startswith("load_")}
    assert total == {**counted_once, "bytes_loaded": 2000, "blends_split": 1, "blends_batched": 1,
                     "bytes_loaded_tier_disk": 1200, "bytes_loaded_tier_memory": 800, "load_seconds_tier_disk": 0.02,
                     "load_seconds_tier_memory": 0.002, "blend_time_s_count": 1, "blend_time_s_mean": 0.04}


def test_the_stats_cross_vllms_engine_to_frontend_serialisation_intact():
    """`vllm serve` runs the engine in a process of its own: SchedulerStats reach the Prometheus logger through
    vLLM's msgpack encoding, which must keep counters, sample lists and gauge keys as they are."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    stats = CacheFuseConnectorStats()
    stats.record(controller_go=1, bytes_loaded_tier_memory=10)
    stats.sample(blend_time_s=0.1, recompute_ratio=0.15)
    stats.set_gauges(1, save_queue_bytes=5)
    sent = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict()))
    received = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(sent))
    assert received.scheduler_stats.kv_connector_stats == stats.data

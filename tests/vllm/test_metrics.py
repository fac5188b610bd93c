"""Connector stats aggregate across workers and steps; Prometheus counters receive them."""

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


def test_prometheus_counters_observe_the_stats():
    registry = CollectorRegistry()

    def bind(cls):
        class Bound(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, registry=registry, **kwargs)
        return Bound

    types = {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=None)
    metrics = CacheFuseConnector.build_prom_metrics(vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]})
    metrics.observe({"requests_fused": 2, "tokens_recomputed": 50, "fallback_malformed_request": 1}, 0)
    metrics.observe({"requests_fused": 1}, 0)
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:cachefuse_requests_fused_total", labels) == 3
    assert registry.get_sample_value("vllm:cachefuse_tokens_recomputed_total", labels) == 50
    assert registry.get_sample_value("vllm:cachefuse_requests_fallback_total",
                                     {**labels, "reason": "malformed_request"}) == 1


def test_tensor_parallel_ranks_count_a_request_once_when_vllm_sums_them():
    """vLLM sums every rank's connector stats: each rank counting a blend's chunks, tokens, time and saves
    multiplied them by the TP size (the response said half at TP=2). Bytes are each rank's own heads."""
    from cachefuse.vllm.worker_side import WorkerSide

    figures = {"tokens_reused": 2500, "tokens_recomputed": 300, "bytes_loaded": 1000, "blend_time_s": 0.04,
               "chunks_hit": 3, "chunks_missed": 1, "holes_saved": 1, "saves_skipped": 2, "save_failures": 1,
               "blend_steps": 3, "blend_batch_size": 2}
    ranks = []
    for rank in (0, 1):
        side = WorkerSide.__new__(WorkerSide)  # only what _record_stats reads
        side.tp_rank, side._stats = rank, CacheFuseConnectorStats()
        side._record_stats(figures)
        ranks.append(side._stats)
    total = ranks[0].aggregate(ranks[1]).reduce()
    # the response's figures once (a split, batched blend counted once); each rank's own bytes
    assert total == {**figures, "bytes_loaded": 2000, "blends_split": 1, "blends_batched": 1}

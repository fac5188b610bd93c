"""The request counters on a real engine count requests, not vLLM's calls nor blends.

vLLM asks the connector about a request every step it waits for blocks, and again after each
preemption, when the request is blended a second time. A KV cache of 1,024 tokens holds two of these
requests (~200 prompt + 100 generated tokens each), so a batch of six fused requests and one malformed
one preempts some and keeps the rest waiting. What reaches Prometheus (the scheduler's and the worker's
connector stats, summed as vLLM sums them) and the scheduler's counters must say six fused and one
fallback; replans after preemption are events and are counted each.
"""

from __future__ import annotations

from collections import Counter

import pytest

from cachefuse.vllm.metrics import CacheFuseConnectorStats
from tests.helpers import vllm_engines as engines

SMALL_KV_CACHE = dict(kv_cache_memory_bytes=2 << 20, max_model_len=512)  # 1,024 tokens of the tiny llama
ORDERS = [("system", "a", "b", "c", "question"), ("system", "c", "a", "d", "question"),
          ("system", "d", "b", "a", "question"), ("system", "b", "c", "d", "question"),
          ("system", "a", "d", "c", "question"), ("system", "c", "b", "a", "question")]


@pytest.fixture(scope="module")
def setup(model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # it overrides kv_cache_memory_bytes (whole GiB)
        llm = engines.start_engine(model_dir, tmp_path_factory.mktemp("metrics-store"), SMALL_KV_CACHE)
    pieces = engines.random_pieces(5, {"system": 20, "a": 60, "b": 50, "c": 40, "d": 45, "question": 10})
    engines.precompute(llm, pieces["system"], [pieces[name] for name in "abcd"])
    yield llm, pieces
    engines.stop_engine(llm)


def collect_stats(monkeypatch, side) -> CacheFuseConnectorStats:
    """Every interval's connector stats `side` hands to vLLM, merged as vLLM's aggregate does."""
    total, original = CacheFuseConnectorStats(), side.get_kv_connector_stats

    def recording():
        stats = original()
        if stats is not None:
            total.data = total.aggregate(stats).data
        return stats

    monkeypatch.setattr(side, "get_kv_connector_stats", recording)
    return total


def test_preempted_and_waiting_requests_are_counted_once(setup, monkeypatch):
    llm, pieces = setup
    prompts, params = [], []
    for order in ORDERS:
        ids, p = engines.named_prompt(pieces, order, selector="cacheblend", recompute_ratio=0.15)
        prompts.append(ids)
        params.append(p)
    prompts.append(prompts[0])
    params.append({"cachefuse": {"chunks": [[0, 10], [5, 20]]}})  # malformed: runs as plain vLLM
    connector = engines.scheduler_connector(llm)
    fallbacks = []
    outcomes = connector._scheduler.outcomes  # every fallback the scheduler decides is said there
    fall_back = outcomes.fall_back
    monkeypatch.setattr(outcomes, "fall_back", lambda *a, **k: fallbacks.append(a) or fall_back(*a, **k))
    scheduler_stats = collect_stats(monkeypatch, connector._scheduler)
    worker_stats = collect_stats(monkeypatch, engines.worker_side())
    before = Counter(connector.counters)
    outputs = engines.generate(llm, prompts, params, 100)
    counted = Counter(connector.counters) - before
    assert [o.kv_transfer_params["cachefuse"]["status"] for o in outputs] == ["fused"] * 6 + ["fallback"]
    assert counted["requests_replanned_after_preemption"] > 0, "nothing was preempted: the KV cache is too large"
    assert len(fallbacks) > 1, "the malformed request never waited: vLLM asked about it once"
    assert (counted["requests_fused"], counted["requests_fallback"], counted["fallback:malformed_request"]) == (6, 1, 1)
    prometheus = scheduler_stats.aggregate(worker_stats).data
    assert (prometheus["requests_fused"], prometheus["requests_fallback"],
            prometheus["fallback_malformed_request"]) == (6, 1, 1), prometheus
    assert prometheus["chunks_hit"] > 6 * 4  # work is counted per blend: a resumed request loads again
    by_tier = {k: v for k, v in prometheus.items() if k.startswith("bytes_loaded_tier_")}
    assert by_tier and sum(by_tier.values()) == prometheus["bytes_loaded"], by_tier  # every byte has its tier
    assert len(prometheus["samples_blend_time_s"]) > 6  # one per blend, replays included
    assert prometheus["samples_recompute_ratio"] == [0.15] * 6  # one per fused request

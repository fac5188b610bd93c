"""examples/grafana/cachefuse.json against a real server's /metrics (the server of test_server.py).

After fused requests (a cold one that stores its chunks, a warm one that loads them) and a malformed one:
- every metric name the dashboard queries is exported by `vllm serve` with CacheFuseConnector, vLLM's own
  and the connector's alike (histograms as `_bucket`/`_sum`/`_count`, counters as `_total`);
- negative control: the same dashboard with a name the server does not export, and with a histogram
  queried without `_bucket`, is reported missing for exactly those;
- the new metrics carry what happened: bytes loaded by tier, the save queue's bound (a gauge, carried as
  each rank's last report), one blend time per blend, the fallback by reason.
"""

from __future__ import annotations

import copy
import json
import urllib.request
from pathlib import Path

from cachefuse.rag_prompt import build_rag_prompt
from tests.helpers.promql import missing_metrics
from tests.vllm.test_server import (  # noqa: F401  (shared fixtures)
    CHUNKS,
    SYSTEM,
    cachefuse_server,
    completion_body,
    post_json,
    tokenizer,
)

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "cachefuse.json"
DEFAULT_SAVE_QUEUE_BYTES = 256 << 20  # CacheFuseConfig.save_queue_bytes; serve.sh does not set it


def scrape(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        assert response.status == 200
        return response.read().decode()


def samples(exposition: str, name: str) -> list[tuple[dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.labels, s.value) for family in text_string_to_metric_families(exposition)
            for s in family.samples if s.name == name]


def test_every_metric_the_dashboard_queries_is_exported(cachefuse_server, tokenizer):  # noqa: F811
    prompt = build_rag_prompt(tokenizer, SYSTEM, [CHUNKS[4], CHUNKS[2]], "Question: how far is the garden?")
    for _ in range(2):  # the first stores its chunks (or finds them), the second loads them
        status, body = post_json(cachefuse_server.base_url, "/v1/completions",
                                 completion_body(prompt.token_ids, prompt.kv_transfer_params()))
        assert status == 200 and body["kv_transfer_params"]["cachefuse"]["status"] == "fused", body
    status, body = post_json(cachefuse_server.base_url, "/v1/completions",
                             completion_body(prompt.token_ids, {"cachefuse": {"chunks": [[5, 3]]}}))
    assert status == 200 and body["kv_transfer_params"]["cachefuse"]["fallback_reason"] == "malformed_request"
    exposition = scrape(cachefuse_server.base_url)
    dashboard = json.loads(DASHBOARD.read_text())

    assert missing_metrics(dashboard, exposition) == {}

    broken = copy.deepcopy(dashboard)
    broken["panels"][1]["targets"] += [
        {"refId": "Y", "expr": "sum(rate(vllm:cachefuse_not_exported_total[5m]))"},
        {"refId": "Z", "expr": "histogram_quantile(0.5, rate(vllm:cachefuse_blend_time_seconds[5m]))"}]
    assert set(missing_metrics(broken, exposition)) == {"vllm:cachefuse_not_exported_total",
                                                        "vllm:cachefuse_blend_time_seconds"}

    by_tier = samples(exposition, "vllm:cachefuse_bytes_loaded_by_tier_total")
    assert by_tier and all(labels["tier"] for labels, _ in by_tier) and sum(v for _, v in by_tier) > 0, by_tier
    assert [v for _, v in samples(exposition, "vllm:cachefuse_save_queue_capacity_bytes")] == [DEFAULT_SAVE_QUEUE_BYTES]
    (blends,) = [v for _, v in samples(exposition, "vllm:cachefuse_blend_time_seconds_count")]
    (fused,) = [v for _, v in samples(exposition, "vllm:cachefuse_requests_fused_total")]
    assert blends >= fused >= 2  # one blend per fused request here (no preemption), more if other tests ran first
    fallbacks = {labels["reason"]: v for labels, v in samples(exposition, "vllm:cachefuse_requests_fallback_total")}
    assert fallbacks.get("malformed_request", 0) >= 1, fallbacks

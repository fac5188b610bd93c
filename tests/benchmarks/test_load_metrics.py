"""benchmarks/load_metrics.py: a load point's figures through vLLM's calculate_metrics (percentiles,
throughput, goodput within the TTFT SLO), whether a rate is sustained, the maximum sustained rate and
the ratios over plain. No server."""

from __future__ import annotations

import pytest
from load_metrics import max_sustained_rate, point_metrics, ratio, ratios_over_plain, sustains

endpoint = pytest.importorskip("vllm.benchmarks.lib.endpoint_request_func")


def answered(ttft_s: float, itl_s: list[float]) -> endpoint.RequestFuncOutput:
    return endpoint.RequestFuncOutput(success=True, ttft=ttft_s, itl=itl_s, latency=ttft_s + sum(itl_s),
                                      output_tokens=len(itl_s) + 1, start_time=0.0)


def failed() -> endpoint.RequestFuncOutput:
    return endpoint.RequestFuncOutput(success=False, error="Traceback ...\nClientConnectorError: refused")


def test_point_metrics_percentiles_throughput_and_goodput():
    # TTFTs 1..100 ms, each request 4 tokens with gaps of 2 ms; two failures; a 10 s window
    outputs = [answered(i / 1e3, [0.002] * 3) for i in range(1, 101)] + [failed(), failed()]
    figures = point_metrics(outputs, duration_s=10.0, slo_ttft_ms=50.0)
    assert (figures["requests"], figures["completed"], figures["errors"]) == (102, 100, 2)
    assert figures["error_samples"] == ["ClientConnectorError: refused"]
    assert figures["requests_per_s"] == pytest.approx(10.0)
    assert figures["output_tokens_per_s"] == pytest.approx(40.0)
    assert figures["goodput_requests_per_s"] == pytest.approx(5.0)  # TTFT 1..50 ms are within the SLO
    assert figures["ttft_p50_ms"] == pytest.approx(50.5)  # numpy's linear interpolation
    assert figures["ttft_p99_ms"] == pytest.approx(99.01)
    assert figures["itl_p50_ms"] == pytest.approx(2.0) and figures["itl_p99_ms"] == pytest.approx(2.0)
    assert figures["e2el_p50_ms"] == pytest.approx(56.5)


def test_a_point_where_nothing_completed_has_no_latencies_and_is_not_sustained():
    figures = point_metrics([failed(), failed()], duration_s=5.0, slo_ttft_ms=50.0)
    assert figures["completed"] == 0 and figures["errors"] == 2
    assert figures["ttft_p99_ms"] is None and figures["itl_p99_ms"] is None  # not calculate_metrics' 0
    assert figures["goodput_requests_per_s"] == 0.0
    assert not sustains(figures, slo_ttft_ms=50.0)


def point(rate: float, ttft_p99_ms: float | None, errors: int = 0, completed: int = 10) -> dict:
    return {"rate": rate, "ttft_p99_ms": ttft_p99_ms, "errors": errors, "completed": completed}


def test_sustained_means_no_errors_and_ttft_p99_within_the_slo():
    assert sustains(point(1, 100.0), slo_ttft_ms=100.0)
    assert not sustains(point(1, 100.1), slo_ttft_ms=100.0)
    assert not sustains(point(1, 10.0, errors=1), slo_ttft_ms=100.0)  # fast but lost a request


def test_max_sustained_rate_stops_at_the_first_violation():
    points = [point(6, 50.0), point(1, 20.0), point(4, 500.0), point(2, 40.0)]  # 6 passes after 4 failed
    assert max_sustained_rate(points, slo_ttft_ms=100.0) == 2
    assert max_sustained_rate([point(1, 20.0), point(2, 30.0)], slo_ttft_ms=100.0) == 2


def test_max_sustained_rate_is_none_when_the_lowest_rate_fails():
    assert max_sustained_rate([point(1, 200.0), point(2, 50.0)], slo_ttft_ms=100.0) is None
    assert max_sustained_rate([], slo_ttft_ms=100.0) is None


def test_ratio_of_missing_figures_is_none():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(3.0, None) is None and ratio(3.0, 0.0) is None


def summary(ttft_p50: float, itl_p99: float, requests_per_s: float, sustained: float | None) -> dict:
    per_rate = [{"rate": 1.0, "ttft_p50_ms": ttft_p50, "itl_p99_ms": itl_p99},
                {"rate": 2.0, "ttft_p50_ms": 2 * ttft_p50, "itl_p99_ms": itl_p99}]
    return {"poisson": {"1.0": per_rate}, "max_sustained_rate": {"1.0": sustained},
            "closed_loop": {"ttft_p50_ms": ttft_p50, "requests_per_s": requests_per_s}}


def test_ratios_over_plain_divide_by_plain():
    summaries = {"plain": summary(100.0, 10.0, 2.0, 2.0), "cachefuse": summary(25.0, 12.0, 5.0, None)}
    ratios = ratios_over_plain(summaries, "cachefuse")
    assert ratios["closed_loop_ttft_p50"] == pytest.approx(0.25)
    assert ratios["closed_loop_requests_per_s"] == pytest.approx(2.5)
    assert ratios["max_sustained_rate"] == {"1.0": None}  # cachefuse sustained none of them
    assert ratios["per_rate"]["1.0"] == [{"rate": 1.0, "ttft_p50": pytest.approx(0.25), "itl_p99": pytest.approx(1.2)},
                                        {"rate": 2.0, "ttft_p50": pytest.approx(0.25), "itl_p99": pytest.approx(1.2)}]

"""The figures of one load point and what benchmarks/serving_load.py derives from them: percentiles,
goodput, whether a rate is sustained, the maximum sustained rate, ratios.

A point's figures are vLLM's own, computed by `vllm.benchmarks.serve.calculate_metrics` (the function
behind `vllm bench serve`'s report) from the `RequestFuncOutput`s of its streaming client:

    TTFT        request start to the first streamed token, per request
    ITL         gaps between streamed chunks after the first, pooled over all requests
    E2EL        request start to the last streamed chunk, per request
    throughput  completed requests (output tokens) / the point's window
    goodput     requests with TTFT <= the SLO / the point's window

Percentiles are numpy's (linear interpolation). Imports vllm only inside point_metrics. Not a script.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

PERCENTILES = (50.0, 99.0)
MAX_ERROR_SAMPLES = 3


def point_metrics(outputs: list[RequestFuncOutput], duration_s: float, slo_ttft_ms: float | None) -> dict:
    """A load point's figures, in ms and per second.

    Args:
        outputs: the records of the point's measured requests, failed ones included.
        duration_s: the point's window (the denominator of throughput and goodput).
        slo_ttft_ms: the TTFT a request must not exceed to count towards goodput; None: no goodput.

    Returns:
        requests, completed, errors, error_samples, duration_s, requests_per_s, output_tokens_per_s,
        goodput_requests_per_s (None without an SLO) and {ttft,itl,e2el}_{p50,p99}_ms (None when no
        request completed).
    """
    from vllm.benchmarks.serve import calculate_metrics

    # it prints failed requests and a plotting tip, and warns when all failed: the report says both
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metrics, _ = calculate_metrics(input_requests=[], outputs=outputs, dur_s=duration_s, tokenizer=None,
                                       selected_percentiles=list(PERCENTILES),
                                       goodput_config_dict={} if slo_ttft_ms is None else {"ttft": slo_ttft_ms})
    figures = {
        "requests": len(outputs), "completed": metrics.completed, "errors": metrics.failed,
        "error_samples": sorted({o.error.strip().splitlines()[-1][:200] for o in outputs
                                 if not o.success and o.error.strip()})[:MAX_ERROR_SAMPLES],
        "duration_s": duration_s, "requests_per_s": metrics.request_throughput,
        "output_tokens_per_s": metrics.output_throughput,
        "goodput_requests_per_s": None if slo_ttft_ms is None else metrics.request_goodput,
    }
    for name, percentiles in (("ttft", metrics.percentiles_ttft_ms), ("itl", metrics.percentiles_itl_ms),
                              ("e2el", metrics.percentiles_e2el_ms)):
        for p, value in percentiles:  # calculate_metrics reports 0 for no requests: None says it
            figures[f"{name}_p{p:g}_ms"] = float(value) if metrics.completed else None
    return figures


def sustains(point: dict, slo_ttft_ms: float) -> bool:
    """A point is sustained when every request completed and its TTFT p99 is within the SLO."""
    return point["completed"] > 0 and point["errors"] == 0 and point["ttft_p99_ms"] <= slo_ttft_ms


def max_sustained_rate(points: list[dict], slo_ttft_ms: float) -> float | None:
    """The highest rate at which it and every lower swept rate was sustained; None when the lowest was not.

    A sustained rate above an unsustained one is noise (a lucky draw of arrivals), not capacity.
    """
    best = None
    for point in sorted(points, key=lambda p: p["rate"]):
        if not sustains(point, slo_ttft_ms):
            break
        best = point["rate"]
    return best


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def ratios_over_plain(summaries: dict[str, dict], name: str) -> dict:
    """`name`'s figures over plain's: closed loop TTFT p50 and throughput, maximum sustained rate per hit
    rate, and per rate TTFT p50 and ITL p99."""
    this, plain = summaries[name], summaries["plain"]
    per_rate = {
        h: [{"rate": mine["rate"], "ttft_p50": ratio(mine["ttft_p50_ms"], base["ttft_p50_ms"]),
             "itl_p99": ratio(mine["itl_p99_ms"], base["itl_p99_ms"])}
            for mine, base in zip(this["poisson"][h], plain["poisson"][h], strict=True)]
        for h in this["poisson"]}
    return {
        "closed_loop_ttft_p50": ratio(this["closed_loop"]["ttft_p50_ms"], plain["closed_loop"]["ttft_p50_ms"]),
        "closed_loop_requests_per_s": ratio(this["closed_loop"]["requests_per_s"],
                                            plain["closed_loop"]["requests_per_s"]),
        "max_sustained_rate": {h: ratio(this["max_sustained_rate"][h], plain["max_sustained_rate"][h])
                               for h in this["max_sustained_rate"]},
        "per_rate": per_rate,
    }

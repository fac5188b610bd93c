"""examples/grafana/cachefuse.json and examples/prometheus/prometheus.yml, without an engine:

- the metric-name extraction (tests/helpers/promql.py) reads the PromQL the dashboard writes: functions,
  grouping clauses, label matchers, ranges, Grafana variables and numbers are not names;
- a name the exposition does not export is reported with where it is queried, as are a counter queried
  without `_total` and a histogram without `_bucket` (the check is not a prefix match);
- every panel queries through the `datasource` variable and filters by the `model_name` variable;
- the scrape config scrapes /metrics where examples/serve.sh listens by default.

That every name the dashboard queries is exported by a real server: tests/vllm/test_dashboard.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tests.helpers.promql import dashboard_metric_names, dashboard_queries, metric_names, missing_metrics

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DASHBOARD = EXAMPLES / "grafana" / "cachefuse.json"

EXPOSITION = """\
# HELP vllm:cachefuse_requests_fused Requests fused.
# TYPE vllm:cachefuse_requests_fused counter
vllm:cachefuse_requests_fused_total{engine="0",model_name="m"} 3.0
# HELP vllm:cachefuse_requests_fallback Requests that ran as plain vLLM, by reason.
# TYPE vllm:cachefuse_requests_fallback counter
# HELP vllm:cachefuse_blend_time_seconds Each blend's time.
# TYPE vllm:cachefuse_blend_time_seconds histogram
vllm:cachefuse_blend_time_seconds_bucket{engine="0",le="0.1",model_name="m"} 1.0
vllm:cachefuse_blend_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 1.0
vllm:cachefuse_blend_time_seconds_count{engine="0",model_name="m"} 1.0
vllm:cachefuse_blend_time_seconds_sum{engine="0",model_name="m"} 0.05
# HELP vllm:num_requests_running Running requests.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def dashboard_of(*exprs: str) -> dict:
    return {"panels": [{"title": "p", "targets": [{"refId": chr(65 + i), "expr": e} for i, e in enumerate(exprs)]}]}


def test_metric_names_skip_functions_clauses_matchers_ranges_variables_and_numbers():
    expr = ('histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:time_to_first_token_seconds_bucket'
            '{model_name=~"$model_name", le!="+Inf"}[$__rate_interval])))')
    assert metric_names(expr) == {"vllm:time_to_first_token_seconds_bucket"}
    ratio = ('sum by (tier) (rate(vllm:a_total{x="rate(b)"}[5m] offset 1h)) / on (tier) group_left '
             'sum by (tier) (rate(vllm:b_total[1m:10s])) > bool 1e3 and vllm:c unless ${x}')
    assert metric_names(ratio) == {"vllm:a_total", "vllm:b_total", "vllm:c"}
    variables = {"templating": {"list": [{"type": "query", "name": "model_name",
                                          "query": {"query": "label_values(vllm:num_requests_running, model_name)"}}]}}
    assert dashboard_metric_names(variables) == {"vllm:num_requests_running": {"variable 'model_name'"}}


def test_every_name_the_exposition_lacks_is_reported_and_only_those():
    fine = dashboard_of("sum(rate(vllm:cachefuse_requests_fused_total[5m]))",
                        "sum by (reason) (rate(vllm:cachefuse_requests_fallback_total[5m]))",  # declared, no sample yet
                        "histogram_quantile(0.5, sum by (le) (rate(vllm:cachefuse_blend_time_seconds_bucket[5m])))",
                        "vllm:num_requests_running")
    assert missing_metrics(fine, EXPOSITION) == {}
    broken = dashboard_of("rate(vllm:cachefuse_requests_fused[5m])",  # a counter without _total
                          "rate(vllm:cachefuse_blend_time_seconds[5m])",  # a histogram without _bucket
                          "vllm:cachefuse_not_exported")
    assert missing_metrics(broken, EXPOSITION) == {
        "vllm:cachefuse_requests_fused": {"panel 'p' target A"},
        "vllm:cachefuse_blend_time_seconds": {"panel 'p' target B"},
        "vllm:cachefuse_not_exported": {"panel 'p' target C"}}


def test_the_dashboard_queries_through_its_variables():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    queries = list(dashboard_queries(dashboard))
    assert len(queries) > 20
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert panel["datasource"]["uid"] == target["datasource"]["uid"] == "${datasource}", panel["title"]
            # every selector of a metric filters by the model variable (no selector left unfiltered)
            selectors = re.findall(r"(vllm:\w+)(\{[^}]*\})?", target["expr"])
            assert all('model_name=~"$model_name"' in matcher for _, matcher in selectors), target["expr"]
    names = dashboard_metric_names(dashboard)
    assert any(n.startswith("vllm:cachefuse_") for n in names) and any(not n.startswith("vllm:cachefuse_")
                                                                      for n in names)


def test_the_scrape_config_scrapes_metrics_where_serve_sh_listens():
    config = yaml.safe_load((EXAMPLES / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    serve = (EXAMPLES / "serve.sh").read_text()
    host = re.search(r'HOST="\$\{HOST:-([^}]+)\}"', serve).group(1)
    port = re.search(r'PORT="\$\{PORT:-([^}]+)\}"', serve).group(1)
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"{host}:{port}"]

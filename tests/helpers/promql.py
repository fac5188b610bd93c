"""The metric names a Grafana dashboard queries, and the names a Prometheus endpoint exports.

Imports only the standard library and prometheus_client's text parser. Not a PromQL parser: it strips
what cannot name a metric (strings, label matchers, ranges, grouping clauses, durations, numbers,
Grafana variables) and keeps every identifier that is not a function call or a keyword. The dashboards
it reads (examples/grafana/) keep to that subset; `tests/examples/test_dashboard.py` pins it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right",
            "inf", "nan"}
_STRIP = [
    re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\''),  # strings (label values, label_replace's arguments)
    re.compile(r"\{[^}]*\}"),  # label matchers
    re.compile(r"\[[^\]]*\]"),  # ranges and subqueries ([5m], [$__rate_interval])
    re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"),  # label lists
    re.compile(r"\$\{?\w+\}?"),  # Grafana variables outside brackets
    re.compile(r"\b\d+(?:ms|s|m|h|d|w|y)\b"),  # durations (offset 5m)
    re.compile(r"(?<![\w:])\d+(?:\.\d*)?(?:[eE][+-]?\d+)?"),  # numbers (0.99, 1e3)
]
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
# Prometheus sample names of each metric type, from the family name the text format declares.
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "untyped": ("",), "unknown": ("",),
             "info": ("_info",), "stateset": ("",), "gaugehistogram": ("_bucket", "_gsum", "_gcount")}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (a histogram's as queried: `..._bucket`)."""
    for pattern in _STRIP:
        expr = pattern.sub(" ", expr)
    names = set()
    for match in _IDENTIFIER.finditer(expr):
        name = match.group()
        if expr[match.end():].lstrip().startswith("(") or name in KEYWORDS:
            continue  # a function (rate, sum, histogram_quantile) or an operator's keyword
        names.add(name)
    return names


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable, rows' nested panels included."""
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                yield f"panel {panel.get('title')!r} target {target.get('refId')}", target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable.get("query")
            query = query.get("query") if isinstance(query, dict) else query
            inner = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query or "")
            yield f"variable {variable.get('name')!r}", inner.group(1) if inner else query


def dashboard_metric_names(dashboard: dict[str, Any]) -> dict[str, set[str]]:
    """Metric name -> where the dashboard queries it."""
    used: dict[str, set[str]] = {}
    for where, expr in dashboard_queries(dashboard):
        for name in metric_names(expr):
            used.setdefault(name, set()).add(where)
    return used


def exported_names(exposition: str) -> set[str]:
    """Every sample name a Prometheus text exposition declares: its samples', and for a family declared
    with no samples yet (a labelled counter nothing has incremented), the ones its type will have."""
    from prometheus_client.parser import text_string_to_metric_families

    names = set()
    for family in text_string_to_metric_families(exposition):
        names.update(sample.name for sample in family.samples)
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names


def missing_metrics(dashboard: dict[str, Any], exposition: str) -> dict[str, set[str]]:
    """The names the dashboard queries that the exposition does not export, with where it queries them."""
    exported = exported_names(exposition)
    return {name: where for name, where in dashboard_metric_names(dashboard).items() if name not in exported}

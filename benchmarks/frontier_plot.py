"""The frontier's figure and table: normalized F1 (and first-token KL) against TTFT speed-up.

Reads only the point dicts benchmarks/frontier.py writes into its JSON, so `frontier.py --replot`
redraws a committed run without measuring anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from frontier_cli import recorded_layout

from cachefuse.eval.qa_set import LAYOUTS

MARKERS = {"fixed": "o", "controller": "s"}
SIDE_MARKERS = {("fusion", "fused"): "P", ("exact", "off"): "X"}
"""Side-axis values away from the defaults' (benchmarks/frontier.py, Axis.side) drawn with their own marker."""


def _marker(axes: dict[str, str]) -> str:
    side = [m for (axis, value), m in SIDE_MARKERS.items() if axes.get(axis) == value]
    return side[0] if side else MARKERS.get(axes.get("ratio_mode"), "^")


def _ci(point: dict[str, Any]) -> tuple[float, float]:
    """The normalized F1's distance to its interval's ends (0 where there is none)."""
    norm = point["quality"]["by_kind"]["all"]["normalized_f1"]
    if norm["ci_low"] is None:
        return 0.0, 0.0
    return max(0.0, norm["value"] - norm["ci_low"]), max(0.0, norm["ci_high"] - norm["value"])


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in result["points"] if p["speedup"] is not None and p["quality"] is not None]
    target = result["targets_at"]
    fig, (ax, ax_kl) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw=dict(width_ratios=[1.6, 1]))
    x_max = max([target["speedup"] * 1.2] + [p["speedup"] * 1.05 for p in points])
    ax.fill_between([target["speedup"], x_max], target["normalized_f1"], 1.3, color="green", alpha=0.06, lw=0)
    ax.axhline(target["normalized_f1"], color="green", lw=0.8, ls="--",
               label=f">= {target['normalized_f1']} at >= {target['speedup']}x: target")
    ax.axvline(target["speedup"], color="green", lw=0.8, ls="--")
    selectors = list(dict.fromkeys(p["axes"]["selector"] for p in points if not p["baseline"]))
    colors = {s: f"C{i}" for i, s in enumerate(selectors)}
    for p in points:
        if p["normalized_f1"] is None:
            continue
        if p["baseline"]:
            style = dict(color="black", marker="D")
        else:
            style = dict(color=colors[p["axes"]["selector"]], marker=_marker(p["axes"]),
                         mfc="none" if p["axes"].get("ratio_mode") == "controller" else None)
        low, high = _ci(p)
        ax.errorbar(p["speedup"], p["normalized_f1"], yerr=[[low], [high]], ms=5, capsize=2, lw=0.6, **style)
        tag = p["name"] if p["baseline"] else p["axes"]["ratio"]
        ax.annotate(tag, (p["speedup"], p["normalized_f1"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
        ax_kl.plot(p["speedup"], max(p["quality"]["kl_mean"], 1e-6), ls="none", **style)
    frontier = sorted((p for p in points if p["on_frontier"]), key=lambda p: p["speedup"])
    ax.plot([p["speedup"] for p in frontier], [p["normalized_f1"] for p in frontier], color="grey", lw=1.2,
            ls="-", zorder=0, label="Pareto frontier")
    default = next(p for p in result["points"] if p.get("default"))
    if default["speedup"] is not None and default["normalized_f1"] is not None:
        ax.plot(default["speedup"], default["normalized_f1"], marker="*", ms=18, mfc="none", mec="red", ls="none",
                label=f"defaults: {default['name']}")
    for selector, color in colors.items():
        ax.plot([], [], color=color, marker="o", ls="none", label=selector)
    ax.plot([], [], color="grey", marker="s", mfc="none", ls="none", label="ratio_mode controller (open)")
    for (axis, value), marker in SIDE_MARKERS.items():
        if any(p.get("axes", {}).get(axis) == value for p in points):
            ax.plot([], [], color="grey", marker=marker, ls="none", label=f"{axis} {value}")
    quality = result["quality"]
    documents = "{}-{}".format(*LAYOUTS[recorded_layout(result)])
    ax.set(xlabel="TTFT speed-up vs plain vLLM (median of paired requests)",
           ylabel="normalized F1, (S - S_reuse) / (S_full - S_reuse), 95% CI",
           title=f"{result['model_name']}: {quality['items']} QA test items "
                 f"({quality['kinds'].get('single', 0)} one-hop, {quality['kinds'].get('multi', 0)} two-hop, "
                 f"{documents} documents each); "
                 f"TTFT on the first {result['speed']['timed_items']}", xscale="log")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7, loc="lower left")
    ax_kl.set(xlabel="TTFT speed-up vs plain vLLM", ylabel="first-token KL(full prefill || fused), mean (0 drawn at 1e-6)",
              yscale="log", xscale="log", title="fidelity")
    from matplotlib.ticker import ScalarFormatter

    for axis in (ax.xaxis, ax_kl.xaxis):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(ScalarFormatter())
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(result: dict[str, Any]) -> str:
    """The frontier's points as a markdown table (baselines first), one row each."""
    lines = ["| configuration | speed-up [95% CI] | norm. F1 all [95% CI] | one-hop | two-hop | KL mean | quality from |",
             "|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        if not (p["on_frontier"] or p["baseline"] or p.get("default")):
            continue
        speed = p["speed"]
        sp = "1.00x" if p["name"] == "plain vLLM" else (
            f"{speed['speedup']:.2f}x [{speed['ci95'][0]:.2f}, {speed['ci95'][1]:.2f}]" if speed else "-")
        cells = []
        for kind in ("all", "single", "multi"):
            norm = ((p["quality"] or {}).get("by_kind", {}).get(kind) or {}).get("normalized_f1") or {}
            value = norm.get("value")
            text = "-" if value is None else f"{value:.2f}"
            if value is not None and kind == "all" and norm.get("ci_low") is not None:
                text += f" [{norm['ci_low']:.2f}, {norm['ci_high']:.2f}]"
            cells.append(text)
        kl = "-" if p["quality"] is None else f"{p['quality']['kl_mean']:.3f}"
        marks = " (defaults)" if p.get("default") else ""
        marks += "" if p["on_frontier"] else " (off the frontier)"
        lines.append(f"| {p['name']}{marks} | {sp} | {' | '.join(cells)} | {kl} | {p['quality_source']} |")
    return "\n".join(lines)


def quality_table(result: dict[str, Any]) -> str:
    """Every point's quality as a markdown table (speed or not): F1, normalized F1 pooled [95% CI] and per
    kind, first-token KL, the recompute fraction."""
    lines = ["| configuration | F1 | normalized F1 [95% CI] | one-hop | two-hop | KL mean | recomputed |",
             "|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        quality = p["quality"]
        if quality is None:
            lines.append(f"| {p['name']} | - | - | - | - | - | - |")
            continue
        cells = []
        for kind in ("all", "single", "multi"):
            norm = (quality["by_kind"].get(kind) or {}).get("normalized_f1") or {}
            text = "-" if norm.get("value") is None else f"{norm['value']:.2f}"
            if kind == "all" and norm.get("ci_low") is not None:
                text += f" [{norm['ci_low']:.2f}, {norm['ci_high']:.2f}]"
            cells.append(text)
        marks = " (defaults)" if p.get("default") else ""
        lines.append(f"| {p['name']}{marks} | {quality['by_kind']['all']['f1']['mean']:.3f} | {' | '.join(cells)} | "
                     f"{quality['kl_mean']:.3f} | {quality['recompute_fraction']:.2f} |")
    return "\n".join(lines)

"""Summaries of `cachefuse eval` runs: scores, paired comparisons, fidelity; JSON, a table and a plot.

Imports numpy and cachefuse.eval.{harness, stats}; matplotlib only in `plot_report`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cachefuse.eval.harness import BASELINES, EvalRuns, ItemRun, setting_name
from cachefuse.eval.stats import mcnemar, mean_se, normalized_score, paired_diff

GATE_SAME_CHUNK_EM = 0.8
GATE_CROSS_CHUNK_GAP = 0.15
"""The probe model's gate (docs/quality.md): full-prefill EM on same-chunk questions, and how far full reuse
must fall below full prefill on cross-chunk ones."""


def _indices_by_kind(runs: EvalRuns) -> dict[str, list[int]]:
    kinds: dict[str, list[int]] = {"all": list(range(len(runs.items)))}
    for i, item in enumerate(runs.items):
        if item.kind != "all":
            kinds.setdefault(item.kind, []).append(i)
    return kinds


def _pick(values: Sequence[Any], indices: Sequence[int]) -> list[Any]:
    return [values[i] for i in indices]


def summarize(runs: EvalRuns, seed: int = 0) -> dict[str, Any]:
    """The report: per setting and item kind, the score with its standard error, the normalized score,
    paired differences against full prefill and against cacheblend at the same ratio, and fidelity."""
    scores = {name: [r.score for r in item_runs] for name, item_runs in runs.runs.items()}
    kinds = _indices_by_kind(runs)
    settings = {}
    for (name, ratio), key in ((s, setting_name(*s)) for s in runs.spec.settings()):
        item_runs = runs.runs[key]
        by_kind = {}
        for kind, idx in kinds.items():
            own, full, reuse = (_pick(scores[k], idx) for k in (key, "full_prefill", "full_reuse"))
            entry = {"score": mean_se(own).to_dict(),
                     "normalized": normalized_score(sum(own) / len(own), full, reuse)}
            if key != "full_prefill":
                entry["vs_full_prefill"] = paired_diff(own, full, seed=seed).to_dict()
            blend = setting_name("cacheblend", ratio)
            if name not in BASELINES and name != "cacheblend" and blend in scores:
                entry["vs_cacheblend"] = paired_diff(own, _pick(scores[blend], idx), seed=seed).to_dict()
            by_kind[kind] = entry
        settings[key] = {"selector": name, "ratio": ratio, "by_kind": by_kind, "fidelity": fidelity(item_runs),
                          "check_layers": runs.check_layers.get(key, [])}
    return {"num_items": len(runs.items), "metric": runs.spec.metric, "max_new_tokens": runs.spec.max_new_tokens,
            "selectors": list(runs.spec.selectors), "ratios": list(runs.spec.ratios),
            "kinds": {k: len(v) for k, v in kinds.items()}, "settings": settings}


def best_selector(summary: dict[str, Any], ratio: float) -> str:
    """The compared selector with the highest mean score at `ratio` over all items (ties: lower mean KL,
    then name): how the quality benchmarks choose on validation what they report on test."""
    rows = [s for s in summary["settings"].values() if s["ratio"] == ratio and s["selector"] in summary["selectors"]]
    best = min(rows, key=lambda s: (-s["by_kind"]["all"]["score"]["mean"], s["fidelity"]["kl_mean"], s["selector"]))
    return best["selector"]


def probe_gate(runs: EvalRuns) -> dict[str, Any]:
    """The probe's gate on runs of probe items: same-chunk full-prefill EM >= GATE_SAME_CHUNK_EM, and
    cross-chunk full reuse >= GATE_CROSS_CHUNK_GAP below full prefill (McNemar, paired)."""
    kinds = [item.kind for item in runs.items]
    full = [r.score for r in runs.runs["full_prefill"]]
    reuse = [r.score for r in runs.runs["full_reuse"]]
    same = mean_se([f for f, k in zip(full, kinds, strict=True) if k == "same_chunk"])
    cross = [(f, r) for f, r, k in zip(full, reuse, kinds, strict=True) if k == "cross_chunk"]
    gap = mcnemar([bool(f) for f, _ in cross], [bool(r) for _, r in cross])
    return {"full_prefill_same_chunk_em": same.to_dict(),
            "full_prefill_cross_chunk_em": mean_se([f for f, _ in cross]).to_dict(),
            "full_reuse_cross_chunk_em": mean_se([r for _, r in cross]).to_dict(),
            "cross_chunk_gap": gap.to_dict(),
            "passed": same.mean >= GATE_SAME_CHUNK_EM and gap.diff >= GATE_CROSS_CHUNK_GAP}


def fidelity(item_runs: Sequence[ItemRun]) -> dict[str, Any]:
    """Means over items (KL also as median and max: its distribution is skewed)."""
    kls = [r.kl for r in item_runs if r.kl is not None]
    deviations = [r.logprob_deviation for r in item_runs if r.logprob_deviation is not None]
    layers = len(item_runs[0].kv_deviation)
    return {
        "kl_mean": statistics.fmean(kls) if kls else None, "kl_median": statistics.median(kls) if kls else None,
        "kl_max": max(kls) if kls else None,
        "logprob_deviation_max": max(deviations) if deviations else None,
        "logprob_deviation_median": statistics.median(deviations) if deviations else None,
        "top1_agree": statistics.fmean(float(r.top1_agree) for r in item_runs),
        "greedy_match": statistics.fmean(r.greedy_match for r in item_runs),
        "kv_deviation_per_layer": [statistics.fmean(r.kv_deviation[layer] for r in item_runs)
                                   for layer in range(layers)],
        "attention_deviation_per_layer": [statistics.fmean(r.attention_deviation[layer] for r in item_runs)
                                          for layer in range(layers)],
        "recompute_fraction": statistics.fmean(r.recompute_fraction for r in item_runs),
    }


def format_table(report: dict[str, Any], kind: str = "all") -> str:
    """One line per setting: score +- SE, normalized, difference to full prefill with its CI, KL."""
    lines = [f"cachefuse eval: {report['num_items']} items ({kind}: {report['kinds'].get(kind, 0)}), "
             f"metric {report['metric']}",
             f"  {'setting':<22} {'score':>14} {'norm':>6} {'vs full [95% CI]':>26} {'p':>8} {'KL mean*':>9} "
             f"{'top1':>5} {'recomp':>6}"]
    for key, setting in report["settings"].items():
        entry = setting["by_kind"].get(kind)
        if entry is None:
            continue
        score, norm = entry["score"], entry["normalized"]
        vs = entry.get("vs_full_prefill")
        vs_text = f"{vs['diff']:+.3f} [{vs['ci_low']:+.3f},{vs['ci_high']:+.3f}]" if vs else "-"
        p_text = f"{vs['p_value']:.2g}" if vs else "-"
        fid = setting["fidelity"]
        kl = fid["kl_mean"] if fid["kl_mean"] is not None else fid["logprob_deviation_median"]
        lines.append(f"  {key:<22} {score['mean']:>7.3f}+-{score['se']:.3f} "
                     f"{'-' if norm is None else f'{norm:.2f}':>6} {vs_text:>26} {p_text:>8} "
                     f"{kl:>9.4f} {fid['top1_agree']:>5.2f} {fid['recompute_fraction']:>6.2f}")
    lines.append("  * through vLLM: the median largest |logprob difference| of the first token instead")
    return "\n".join(lines)


def _divergence(setting: dict[str, Any]) -> float:
    """Mean KL, or (through vLLM, where there is none) the median first-token logprob deviation."""
    fid = setting["fidelity"]
    return fid["kl_mean"] if fid["kl_mean"] is not None else fid["logprob_deviation_median"]


def plot_report(report: dict[str, Any], path: str | Path, kind: str = "all", title: str = "") -> None:
    """Score vs ratio per selector (with full prefill and full reuse as lines), and mean KL vs ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_score, ax_kl) = plt.subplots(1, 2, figsize=(11, 4.2))
    settings = report["settings"]
    for baseline, style in (("full_prefill", "k--"), ("full_reuse", "r:")):
        entry = settings[baseline]
        ax_score.axhline(entry["by_kind"][kind]["score"]["mean"], color=style[0], linestyle=style[1:],
                         label=baseline)
        ax_kl.axhline(max(_divergence(entry), 1e-8), color=style[0], linestyle=style[1:], label=baseline)
    for selector in report["selectors"]:
        rows = [s for s in settings.values() if s["selector"] == selector]
        ratios = [100 * s["ratio"] for s in rows]
        means = [s["by_kind"][kind]["score"]["mean"] for s in rows]
        errors = [1.96 * s["by_kind"][kind]["score"]["se"] for s in rows]
        ax_score.errorbar(ratios, means, yerr=errors, marker="o", capsize=3, label=selector)
        ax_kl.plot(ratios, [max(_divergence(s), 1e-8) for s in rows], marker="o", label=selector)
    ax_score.set(xlabel="recompute ratio (%)", ylabel=f"{report['metric']} ({kind})",
                 title=title or f"score vs ratio, {report['kinds'][kind]} items")
    kl_known = settings["full_reuse"]["fidelity"]["kl_mean"] is not None
    ax_kl.set(xlabel="recompute ratio (%)", yscale="log",
              ylabel="KL(full || fused), mean" if kl_known else "max |logprob diff|, median",
              title="last-token KL to full prefill" if kl_known else "first-token logprobs vs plain vLLM")
    ax_score.legend(fontsize=8)
    ax_kl.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

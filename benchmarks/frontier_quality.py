"""The frontier's quality half: reference-engine runs per quality group, their summaries, the neighbour-fusion
offline step, and the paired comparison of query-aware selectors with cacheblend.

Imported by benchmarks/frontier.py (read its docstring for the axes and what a configuration is). Imports
cachefuse's eval and offline modules inside functions, so `frontier.py --replot` needs no model.

Raw results are kept per item (`groups[group][setting] = {"scores", "kl", "recompute_fraction"}`, items in
`eval_items` order) and written into the frontier's JSON, so points and comparisons can be rebuilt from a
file (`frontier.py --quality-from`) and joined with timings measured later (`--speed-from`).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from frontier_cli import check_layout

QUERY_AWARE = ("qcfuse", "fusionrag")
"""Selectors compared, paired, with cacheblend at each ratio (issue 30: "at 15%, a query-aware selector at
or above cacheblend on the test split")."""
AGAINST = "cacheblend"


def neighbour_offline(num_neighbours: int) -> Callable[..., dict[str, Any] | None]:
    """The neighbour-fusion axis's offline step: for its non-first values, the reference engine's store gets
    every document of the eval items as its base variant and, with cachefuse.offline.neighbours.fuse_neighbours
    (the model's own embeddings, N = `num_neighbours`), its neighbour-fused variant: what
    `cachefuse precompute --fuse-neighbours N` stores for a knowledge base of these documents. Returns
    what it did (None for the first value: base variants only, stored per item by the harness)."""

    def offline(engine: Any, tokenizer: Any, eval_items: list, label: str) -> dict[str, Any] | None:
        from cachefuse.eval.harness import store_base_variants
        from cachefuse.offline.neighbours import fuse_neighbours, model_embedder
        from cachefuse.rag_prompt import build_rag_prompt

        if label == "base":
            return None
        prompts = [build_rag_prompt(tokenizer, i.system, i.chunks, i.question) for i in eval_items]
        for prompt in prompts:
            store_base_variants(engine, prompt)
        documents = list({tuple(ids): None for p in prompts for ids in p.chunk_token_ids[1:]})
        system = prompts[0].chunk_token_ids[0]
        if any(p.chunk_token_ids[0] != system for p in prompts):
            raise ValueError("neighbour fusion keys variants after one system prompt; the items have several")
        started = time.process_time()
        report = fuse_neighbours(engine, system, [list(d) for d in documents], num_neighbours,
                                 embedder=model_embedder(engine), clock=time.process_time)
        return {"documents": len(documents), "neighbours": num_neighbours, "stored": len(report.stored),
                "skipped": len(report.skipped), "failed": len(report.failed), "embedder": "model",
                "cpu_seconds": round(time.process_time() - started, 1),
                "cpu_seconds_per_document_median": statistics.median(report.seconds) if report.seconds else None}

    return offline


def engine_axes(all_axes) -> list:
    """Axes the reference engine is built per value of (reference-measured, other than selector and ratio,
    which run_eval sweeps itself)."""
    return [a for a in all_axes if a.quality == "reference" and a.name not in ("selector", "ratio")]


def reference_group(all_axes) -> str:
    """The quality group of the full grid: every side axis at its first value (base entries, exact places
    on). Its full prefill and full reuse normalize every point (FusionRAG's Eq. 11 normalizes by the base
    cache's full reuse), and the side groups and the query-aware target are read against it, wherever the
    defaults' mark sits."""
    return "/".join(next(iter(a.values)) for a in engine_axes(all_axes)) or "base"


def quality_groups(all_axes, configs) -> dict[str, list]:
    """Configurations by what the reference engine must be built with (`engine_axes`' labels, "/"-joined)."""
    names = [a.name for a in engine_axes(all_axes)]
    groups: dict[str, list] = {}
    for config in configs:
        groups.setdefault("/".join(config.label(a) for a in names) or "base", []).append(config)
    return groups


def group_settings(members) -> dict[str, tuple[str, float]]:
    """The settings a group needs: setting name -> (selector, ratio), the baselines included."""
    from cachefuse.eval.harness import BASELINES, setting_name

    pairs = {(c.overrides["selector"], c.overrides["recompute_ratio"]) for c in members}
    return {**{name: (name, 1.0 if name == "full_prefill" else 0.0) for name in BASELINES},
            **{setting_name(s, r): (s, r) for s, r in sorted(pairs)}}


def measure_quality(args, all_axes, configs, eval_items, done: dict[str, dict],
                    checkpoint: Callable[[dict, dict], None] = lambda groups, offline: None
                    ) -> tuple[dict[str, dict], dict[str, Any]]:
    """Per quality group and setting ("cacheblend@0.15", "full_prefill", ...), the per-item scores, KLs and
    recompute fractions of run_eval. A group already in `done` (an earlier run's, same items) keeps what it
    has and only its missing settings are measured (with the baselines, which every run_eval repeats: they
    must equal the earlier ones item by item, or the run stops). Returns (groups, offline reports per
    group); `checkpoint(groups, offline)` after each measured group."""
    from cachefuse.config import CacheFuseConfig
    from cachefuse.eval.harness import BASELINES, EvalSpec, reference_engine, run_eval

    out, offline_reports = {}, {}
    axes_of_engine = engine_axes(all_axes)
    for group, members in quality_groups(all_axes, configs).items():
        if getattr(args, "groups", None) is not None and group not in args.groups:
            continue
        earlier = done.get(group, {})
        missing = {name: pair for name, pair in group_settings(members).items() if name not in earlier}
        if not missing:
            out[group] = earlier
            continue
        engine_fields = {k: v for a in axes_of_engine for k, v in a.values[members[0].label(a.name)].items()}
        engine, tokenizer = reference_engine(args.model, CacheFuseConfig.from_dict(engine_fields))
        reports = {a.name: a.offline(engine, tokenizer, eval_items, members[0].label(a.name))
                   for a in axes_of_engine if a.offline is not None}
        reports = {name: report for name, report in reports.items() if report is not None}
        pairs = [pair for name, pair in missing.items() if name not in BASELINES]
        spec = EvalSpec(selectors=tuple(dict.fromkeys(s for s, _ in pairs)),
                        ratios=tuple(dict.fromkeys(r for _, r in pairs)), only=frozenset(pairs),
                        metric="f1", max_new_tokens=args.max_new_tokens)
        runs = run_eval(engine, args.tokenizer, eval_items, spec, desc=f"quality [{group}]", keep_store=bool(reports))
        measured = {name: {"scores": [r.score for r in item_runs], "kl": [round(r.kl, 6) for r in item_runs],
                           "recompute_fraction": [round(r.recompute_fraction, 6) for r in item_runs]}
                    for name, item_runs in runs.runs.items()}
        for name in BASELINES:
            if name in earlier and earlier[name]["scores"] != measured[name]["scores"]:
                raise SystemExit(f"quality [{group}]: {name} differs from the earlier run's item by item, so the "
                                 "settings measured now and then are not comparable (other code or model?)")
        out[group] = {**earlier, **measured}
        if reports:
            offline_reports[group] = reports
        checkpoint(out, offline_reports)
    return out, offline_reports


def by_kind(kinds: list[str]) -> dict[str, list[int]]:
    """Item indices per kind, "all" first."""
    return {kind: [i for i, k in enumerate(kinds) if kind in ("all", k)] for kind in ("all", *sorted(set(kinds)))}


def summarize_quality(setting: dict, baselines: tuple[dict, dict], kinds: list[str], seed: int) -> dict[str, Any]:
    """F1, normalized F1 with its interval (against `baselines`: full prefill's and full reuse's per-item
    results), per kind and pooled; first-token KL; recompute fraction."""
    from cachefuse.eval.stats import mean_se, normalized_bootstrap

    out = {}
    for kind, idx in by_kind(kinds).items():
        own, full, reuse = ([values["scores"][i] for i in idx] for values in (setting, *baselines))
        out[kind] = {"f1": mean_se(own).to_dict(),
                     "normalized_f1": normalized_bootstrap(own, full, reuse, seed=seed).to_dict()}
    return {"by_kind": out, "kl_mean": statistics.fmean(setting["kl"]), "kl_median": statistics.median(setting["kl"]),
            "recompute_fraction": statistics.fmean(setting["recompute_fraction"])}


def compare_pair(a: dict, b: dict, baselines: tuple[dict, dict], kinds: list[str], seed: int) -> dict[str, Any]:
    """Setting `a` against setting `b` item by item, per kind and pooled: the F1 and first-token KL
    differences (paired bootstrap) and the normalized F1 difference (joint bootstrap against `baselines`);
    `verdict` reads the pooled F1 difference's interval: "above" (it excludes 0 from above), "below", or
    "no significant difference"."""
    from cachefuse.eval.stats import paired_bootstrap, paired_normalized_bootstrap

    kinds_out = {}
    for kind, idx in by_kind(kinds).items():
        pick = [[values["scores"][i] for i in idx] for values in (a, b, *baselines)]
        kinds_out[kind] = {
            "f1": paired_bootstrap(pick[0], pick[1], seed=seed).to_dict(),
            "normalized_f1": paired_normalized_bootstrap(*pick, seed=seed).to_dict(),
            "kl": paired_bootstrap([a["kl"][i] for i in idx], [b["kl"][i] for i in idx], seed=seed).to_dict()}
    f1 = kinds_out["all"]["f1"]
    verdict = "above" if f1["ci_low"] > 0 else "below" if f1["ci_high"] < 0 else "no significant difference"
    return {"by_kind": kinds_out, "verdict": verdict, "at_or_above": f1["diff"] >= 0}


def paired_comparisons(groups: dict[str, dict], baselines: tuple[dict, dict], kinds: list[str],
                       seed: int) -> list[dict[str, Any]]:
    """Each query-aware selector against cacheblend at the same ratio in the same quality group, item by item
    (`compare_pair`)."""
    out = []
    for group, settings in groups.items():
        for name in settings:
            selector, _, ratio = name.partition("@")
            against = f"{AGAINST}@{ratio}"
            if selector not in QUERY_AWARE or against not in settings:
                continue
            out.append({"group": group, "ratio": float(ratio), "selector": selector, "against": AGAINST,
                        "difference": f"{selector} - {AGAINST}",
                        **compare_pair(settings[name], settings[against], baselines, kinds, seed)})
    return out


def side_comparisons(groups: dict[str, dict], reference: str, baselines: tuple[dict, dict], kinds: list[str],
                     seed: int) -> list[dict[str, Any]]:
    """What a side axis's value changes (benchmarks/frontier.py, Axis.side): each setting of each other group
    against the same setting in the `reference` group, item by item (`compare_pair`; the
    baselines are the same prompts computed in full and reused, so they are not compared)."""
    from cachefuse.eval.harness import BASELINES

    out = []
    for group, settings in groups.items():
        if group == reference:
            continue
        for name, a in settings.items():
            b = groups[reference].get(name)
            if name in BASELINES or b is None:
                continue
            selector, _, ratio = name.partition("@")
            out.append({"group": group, "ratio": float(ratio), "selector": selector, "against": reference,
                        "difference": f"{name} [{group}] - [{reference}]",
                        **compare_pair(a, b, baselines, kinds, seed)})
    return out


def comparison_table(comparisons: list[dict[str, Any]]) -> str:
    """The paired comparisons as a markdown table."""
    lines = ["| group | ratio | difference | F1 [95% CI] | normalized F1 [95% CI] | one-hop F1 | two-hop F1 | "
             "KL [95% CI] | verdict |", "|---|---|---|---|---|---|---|---|---|"]

    def cell(d: dict) -> str:
        if d.get("diff") is None:
            return "-"
        return f"{d['diff']:+.3f}" + ("" if d.get("ci_low") is None else f" [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]")

    for c in comparisons:
        kinds = c["by_kind"]
        lines.append(f"| {c['group']} | {c['ratio']:g} | {c['difference']} | {cell(kinds['all']['f1'])} | "
                     f"{cell(kinds['all']['normalized_f1'])} | {cell(kinds.get('single', {}).get('f1', {}))} | "
                     f"{cell(kinds.get('multi', {}).get('f1', {}))} | {cell(kinds['all']['kl'])} | {c['verdict']} |")
    return "\n".join(lines)


def earlier_quality(paths: list[Path], items: list, layout: str) -> tuple[dict[str, dict], dict[str, Any]]:
    """Per-item quality groups (and offline reports) of earlier runs over the same items, later files winning."""
    groups, offline = {}, {}
    for path in paths:
        quality = json.loads(path.read_text())["quality"]
        if quality["items"] != len(items):
            raise SystemExit(f"--quality-from {path}: {quality['items']} items, this run has {len(items)}")
        check_layout("--quality-from", path, quality, layout)
        for name, settings in quality["groups"].items():  # one group's settings may come from several runs
            groups[name] = {**groups.get(name, {}), **settings}
        offline.update(quality.get("offline") or {})
    return groups, offline


def query_aware_target(comparisons: list[dict[str, Any]], reference: str) -> dict[str, Any]:
    """Issue 30's "at 15%, a query-aware selector at or above cacheblend on the test split (paired, with CI)",
    read in the defaults' quality group."""
    at_15 = [c for c in comparisons if c["ratio"] == 0.15 and c["group"] == reference]
    best = max(at_15, key=lambda c: c["by_kind"]["all"]["f1"]["diff"], default=None)
    return {"goal": "at 15%, a query-aware selector's F1 at or above cacheblend's (paired, 95% CI)",
            "met": bool(best and best["at_or_above"]), "significantly_above": bool(best and best["verdict"] == "above"),
            "best": best and {"selector": best["selector"], "f1_diff": best["by_kind"]["all"]["f1"],
                              "normalized_f1_diff": best["by_kind"]["all"]["normalized_f1"], "verdict": best["verdict"]}}

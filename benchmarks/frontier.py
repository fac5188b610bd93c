"""The quality / speed frontier: every configuration's normalized F1 against its TTFT speed-up through vLLM.

    make model && python benchmarks/frontier.py            # SmolLM2-135M-Instruct: quality and speed
    python benchmarks/frontier.py --quick                  # a smoke run (2 selectors, 2 ratios, 4 items)
    python benchmarks/frontier.py --quality-only ...       # quality alone (any machine), speed None
    python benchmarks/frontier.py --speed-only ...         # speed alone (a quiet machine)
    python benchmarks/frontier.py --quality-from q.json --speed-from s.json ...   # join them, measure nothing

A configuration is one value on each axis of `axes()`; an axis is a named set of CacheFuseConfig
overrides, so a new axis is one entry there (with, where it needs one, an offline step that fills the
store before its quality is measured). Axes: selector (cacheblend, epic, cachecraft, fusionrag, qcfuse)
x recompute ratio (5-90%) x ratio_mode (fixed, controller) x fusion (base; fused: `default_variant:
fused` over neighbour-fused entries that cachefuse.offline.neighbours stores for every document of the
items, N = `--neighbours`, the model's own embeddings) x exact (on; off: `exact_places: false`, every
non-system chunk blended as the papers do). Fusion and exact are side axes: their other values are
measured one at a time and only with `--side-settings` (default cacheblend and qcfuse at 15%), so each
costs a few reference runs rather than a copy of the grid.

Quality (reference engine, cachefuse.eval.harness.run_eval, one process, as many torch threads as
`--cpus`; benchmarks/frontier_quality.py): on `--items` test items of the QA set (cachefuse.eval.qa_set,
one- and two-hop alternating; `--layout long`: the same questions over 10-12 documents), token F1 of 8
greedy tokens, normalized as FusionRAG's Eq. 11,
(S - S_full_reuse) / (S_full_prefill - S_full_reuse) against the defaults' group's baselines, with a
bootstrap 95% interval over items, pooled and per kind (single = one hop, multi = two hops), and the mean
first-token KL(full prefill || fused). One reference engine per quality group (the values of the
reference-measured axes other than selector and ratio: "base/on", "fused/on", "base/off"); the per-item
results are kept in the JSON (`quality.groups`). Paired comparisons (`paired`): qcfuse and fusionrag
against cacheblend at each ratio in each group, per item, F1 and KL by paired bootstrap and normalized F1
by a joint bootstrap, per kind; `targets.query_aware_at_15` reads the defaults' group at 15%.

Speed (vLLM, benchmarks/frontier_ttft.py): on the first `--timed-items` of the same prompts, each
configuration's TTFT against plain vLLM's, paired request by request in the same pinned engine.
Speed depends only on the axes that change what the blend computes (selector, ratio, ratio_mode,
exact); a quality-only axis (fusion: a fused entry loads like a base one) is timed once, at its first value.

ratio_mode "controller" lets the loading controller raise each request's ratio above the configured
one, or run it as plain vLLM (no-go). Its quality is read from what the controller did with the timed
requests: when every one ran at the configured ratio, the fixed configuration's quality; when every one
fell back, full prefill's (normalized 1); otherwise none is claimed (`quality_source` says which).

Long quality runs: each measured group is checkpointed to `<out>.partial.json` (resume with
`--quality-from` it); `--groups-only` (with `--groups`) measures a share of the groups and settings in one
process, to be joined by `--quality-from share1.json share2.json ...` (a group's settings merge across files).

Writes `--out` (JSON) and, with speed, the plot next to it (.png): normalized F1 vs speed-up, the Pareto
frontier, the configuration CacheFuseConfig's defaults pick, and the target region (>= 0.90 at >= 2.5x).
"""

from __future__ import annotations

import itertools
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS.parent))
sys.path.insert(0, str(BENCHMARKS))

from frontier_cli import EXACT, FUSION, MAX_NEW_TOKENS, parse_args  # noqa: E402
from frontier_quality import (  # noqa: E402
    comparison_table,
    earlier_quality,
    measure_quality,
    neighbour_offline,
    paired_comparisons,
    quality_groups,
    query_aware_target,
    reference_group,
    side_comparisons,
    summarize_quality,
)
from frontier_ttft import earlier_speed, measure_speed, speed_groups, speed_key, worker_main  # noqa: E402

from cachefuse.config import CacheFuseConfig  # noqa: E402

TARGET_NORMALIZED_F1, TARGET_SPEEDUP = 0.90, 2.5


@dataclass(frozen=True)
class Axis:
    """One dimension of the frontier: named values, each a set of CacheFuseConfig overrides."""

    name: str
    values: dict[str, dict[str, Any]]
    quality: str
    """"reference": each value's quality is measured on the reference engine; "decisions": read from
    what vLLM did with the timed requests (the controller's ratio or no-go)."""
    moves_speed: bool = True
    """False: the value changes quality only (e.g. which variant is loaded), so speed is timed once."""
    offline: Callable[[Any, Any, list, str], dict | None] | None = field(default=None, compare=False)
    """Before a value's quality is measured: (reference engine, tokenizer, eval items, value label) -> fills
    the store for every item and says what it did (None: nothing, each item stores its own base variants)."""
    side: bool = False
    """A side axis: its values other than the first (the full grid's: base entries, exact places on) are
    combined only with the settings (selector@ratio) in `side_settings`, and with the other side axes at their
    first values (one moved at a time), so that each costs a few reference runs, not a copy of the grid."""




def axes(selectors, ratios, modes, fusion=tuple(FUSION), exact=tuple(EXACT), neighbours=10) -> tuple[Axis, ...]:
    """The frontier's axes; `fusion` and `exact` are side axes (Axis.side), each value list starting with
    the full grid's. Neighbour fusion is quality-only: a fused entry is loaded like a base one (same bytes,
    same rows), so its speed is the base configuration's and the vLLM worker needs no offline step."""
    return (
        Axis("selector", {s: {"selector": s} for s in selectors}, quality="reference"),
        Axis("ratio", {f"{r:g}": {"recompute_ratio": r} for r in ratios}, quality="reference"),
        Axis("ratio_mode", {m: {"ratio_mode": m} for m in modes}, quality="decisions"),
        Axis("fusion", {v: FUSION[v] for v in fusion}, quality="reference", moves_speed=False,
             offline=neighbour_offline(neighbours), side=True),
        Axis("exact", {v: EXACT[v] for v in exact}, quality="reference", side=True),
    )


@dataclass(frozen=True)
class Configuration:
    labels: tuple[tuple[str, str], ...]
    """(axis name, value label) per axis, in axes() order."""
    overrides: dict[str, Any]

    @property
    def name(self) -> str:
        return "/".join(label for _, label in self.labels)

    def label(self, axis: str) -> str:
        return dict(self.labels)[axis]


def configurations(all_axes: tuple[Axis, ...], side_settings: set[str] | None = None) -> list[Configuration]:
    """Every combination of one value per axis, side axes (Axis.side) moved one at a time and only with the
    settings in `side_settings` (None: with every setting): "cacheblend@0.15" for every side axis,
    "fusion:cacheblend@0.05" for that axis alone; overrides are checked as a
    CacheFuseConfig (a bad value fails here, at start-up, naming the field)."""
    out = []
    for combo in itertools.product(*(axis.values.items() for axis in all_axes)):
        overrides = {k: v for _, fields in combo for k, v in fields.items()}
        moved = [a for a, (label, _) in zip(all_axes, combo, strict=True) if a.side and label != next(iter(a.values))]
        setting = f"{overrides.get('selector')}@{overrides.get('recompute_ratio', 0):g}"
        if len(moved) > 1 or (moved and side_settings is not None
                              and not {setting, f"{moved[0].name}:{setting}"} & side_settings):
            continue
        CacheFuseConfig.from_dict(overrides)
        out.append(Configuration(tuple((axis.name, label) for axis, (label, _) in zip(all_axes, combo, strict=True)),
                                 overrides))
    return out


def like_defaults(config: Configuration, ignoring: frozenset[str] | set[str] = frozenset()) -> bool:
    """Every override of `config` but the fields in `ignoring` is CacheFuseConfig's default value."""
    defaults = CacheFuseConfig()
    return all(getattr(defaults, k) == v for k, v in config.overrides.items() if k not in ignoring)


def default_configuration(configs: list[Configuration]) -> Configuration:
    """The configuration whose overrides CacheFuseConfig's defaults already have; in a grid without the
    default ratio_mode (a fixed-only quality run), its fixed twin: the controller fusing every request at
    its floor runs exactly that setting, so the mark stands for what the defaults do when they fuse."""
    defaults = CacheFuseConfig()
    for config in configs:
        if like_defaults(config):
            return config
    if not any(c.overrides.get("ratio_mode") == defaults.ratio_mode for c in configs):
        for config in configs:
            if config.overrides.get("ratio_mode") == "fixed" and like_defaults(config, {"ratio_mode"}):
                return config
    fields = sorted({k for c in configs for k in c.overrides})
    raise SystemExit("the defaults' configuration is not in the grid: add "
                     + ", ".join(f"{k}={getattr(defaults, k)!r}" for k in fields) + " to the axes' values")


def default_mark(default: Configuration) -> str:
    """What the defaults' mark is: the defaults' own configuration or its fixed twin."""
    if default.overrides.get("ratio_mode") == CacheFuseConfig().ratio_mode:
        return "the defaults' configuration"
    return "the defaults' fixed twin (no ratio_mode controller in the grid; the controller fusing at its floor runs it)"


def full_reuse_host(configs: list[Configuration], all_axes) -> Configuration:
    """The timed configuration in whose engine full_reuse is timed: the defaults' other settings at ratio_mode
    fixed (in a controller's engine, the default one, full reuse could be turned down and timed as plain
    vLLM), quality-only axes aside (only their first value is timed), else the first fixed configuration,
    else the first."""
    defaults = CacheFuseConfig()
    ignoring = {"ratio_mode"} | {k for a in all_axes if not a.moves_speed for fields in a.values.values() for k in fields}
    timed = [c for members in speed_groups(configs, all_axes).values() for c in members]

    def rank(config: Configuration) -> tuple[bool, bool]:
        fixed = config.overrides.get("ratio_mode", defaults.ratio_mode) == "fixed"
        return not fixed, not like_defaults(config, ignoring)

    return min(timed, key=rank)


# --------------------------------------------------------------------------- the frontier


def decided_setting(config: Configuration, speed: dict | None) -> tuple[str | None, str]:
    """The reference setting whose quality `config` has, and why. ratio_mode "controller": what the
    controller did with every timed request (module docstring); otherwise the configuration's own setting."""
    from cachefuse.eval.harness import setting_name

    selector, ratio = config.overrides["selector"], config.overrides["recompute_ratio"]
    own = setting_name(selector, ratio)
    if config.overrides.get("ratio_mode", "fixed") != "controller":
        return own, "measured"
    if speed is None:
        return None, "not timed: the controller's decisions are unknown"
    made = speed["decisions"]
    if made["fused"] == 0:
        return "full_prefill", f"controller: no-go on all {made['requests']} timed requests (plain vLLM)"
    if made["fused"] == made["requests"] and made["ratios"] == [round(ratio, 6)]:
        return own, f"controller: fused all {made['requests']} timed requests at the configured ratio"
    return None, f"controller: mixed decisions ({made['fused']}/{made['requests']} fused at {made['ratios']})"


def build_points(all_axes, configs, quality, speed, kinds, default, seed) -> list[dict[str, Any]]:
    """One point per configuration, plus plain vLLM and full reuse, each with quality and speed where known.
    Every point is normalized against the reference group's full prefill and full reuse (`reference_group`:
    base entries, as FusionRAG's Eq. 11), so another group's gain over it shows; KL is against the full
    prefill of the point's own group (the same prompt computed in full: the same logits)."""
    group_of = {c.name: g for g, members in quality_groups(all_axes, configs).items() for c in members}
    reference = reference_group(all_axes)
    base = quality[reference]
    baselines = (base["full_prefill"], base["full_reuse"])
    points = [{"name": "plain vLLM", "baseline": True, "speedup": 1.0, "speed": None, "quality_source": "definition",
               "quality": summarize_quality(base["full_prefill"], baselines, kinds, seed)},
              {"name": "full_reuse", "baseline": True, "speed": speed.get("full_reuse"), "quality_source": "measured",
               "quality": summarize_quality(base["full_reuse"], baselines, kinds, seed)}]
    points[1]["speedup"] = points[1]["speed"]["speedup"] if points[1]["speed"] else None
    for name, group in quality.items():  # full reuse over another group's entries (e.g. neighbour-fused ones)
        if name != reference and group["full_reuse"]["scores"] != base["full_reuse"]["scores"]:
            points.append({**points[1], "name": f"full_reuse [{name}]", "group": name,
                           "quality": summarize_quality(group["full_reuse"], baselines, kinds, seed)})
    for config in configs:
        timed = speed.get(speed_key(config, all_axes))
        setting, source = decided_setting(config, timed)
        group = quality[group_of[config.name]]
        points.append({"name": config.name, "baseline": False, "axes": dict(config.labels), "overrides": config.overrides,
                       "default": config == default, "speed": timed, "speedup": timed["speedup"] if timed else None,
                       "group": group_of[config.name], "quality_setting": setting, "quality_source": source,
                       "quality": None if setting is None else summarize_quality(group[setting], baselines, kinds, seed)})
    for point in points:
        point["normalized_f1"] = (point["quality"] or {}).get("by_kind", {}).get("all", {}).get(
            "normalized_f1", {}).get("value")
    mark_frontier(points)
    return points


def same_computation(p: dict[str, Any], q: dict[str, Any]) -> bool:
    """p and q are one setting timed twice: ratio_mode twins (same group and overrides but ratio_mode) whose
    quality is the same reference setting, i.e. the controller fused every timed request at the configured
    ratio. Their speed-ups differ by timing noise alone, so neither may push the other off the frontier."""
    if p["baseline"] or q["baseline"] or p is q:
        return False
    rest = [{k: v for k, v in x["overrides"].items() if k != "ratio_mode"} for x in (p, q)]
    return (rest[0] == rest[1] and p["group"] == q["group"] and p["quality_setting"] is not None
            and p["quality_setting"] == q["quality_setting"])


def mark_frontier(points: list[dict[str, Any]]) -> None:
    """`on_frontier`: no other point is at least as fast and at least as good, and better in one (a point's
    ratio_mode twin running the same computation, `same_computation`, does not count)."""
    known = [p for p in points if p["speedup"] is not None and p["normalized_f1"] is not None]
    for p in points:
        p["on_frontier"] = p in known and not any(
            q["speedup"] >= p["speedup"] and q["normalized_f1"] >= p["normalized_f1"]
            and (q["speedup"] > p["speedup"] or q["normalized_f1"] > p["normalized_f1"])
            and not same_computation(p, q) for q in known)


def targets(points: list[dict[str, Any]]) -> dict[str, Any]:
    reaching = [p for p in points if not p["baseline"] and p["speedup"] is not None
                and p["normalized_f1"] is not None and p["normalized_f1"] >= TARGET_NORMALIZED_F1]
    fast = [p for p in points if not p["baseline"] and p["normalized_f1"] is not None
            and p["speedup"] is not None and p["speedup"] >= TARGET_SPEEDUP]
    default = next(p for p in points if p.get("default"))
    best_speed = max(reaching, key=lambda p: p["speedup"], default=None)
    best_quality = max(fast, key=lambda p: p["normalized_f1"], default=None)
    return {
        "goal": f">= {TARGET_NORMALIZED_F1} normalized F1 at >= {TARGET_SPEEDUP}x TTFT vs plain vLLM, on the frontier",
        "met": bool(best_speed and best_speed["speedup"] >= TARGET_SPEEDUP),
        "fastest_at_target_quality": best_speed and {k: best_speed[k] for k in ("name", "speedup", "normalized_f1")},
        "best_quality_at_target_speed": best_quality and {
            k: best_quality[k] for k in ("name", "speedup", "normalized_f1")},
        "defaults": {k: default[k] for k in ("name", "speedup", "normalized_f1", "on_frontier")},
        "defaults_on_frontier": default["on_frontier"]}


# --------------------------------------------------------------------------- command line


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.ttft_worker is not None:
        worker_main(args.ttft_worker, args.ttft_result, args.cpus)
        return 0
    from frontier_plot import plot, quality_table, table

    if args.replot:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return 0
    import torch
    from transformers import AutoTokenizer
    from vllm_ttft import parse_cpus, recorded_env, worker_env

    from cachefuse.eval.qa_set import eval_items, make_items

    all_axes = axes(args.selectors, args.ratios, args.ratio_modes, args.fusion, args.exact, args.neighbours)
    configs = configurations(all_axes, args.side_settings)
    if args.settings is not None:
        configs = [c for c in configs if f"{c.overrides['selector']}@{c.overrides['recompute_ratio']:g}" in args.settings]
    default = None if args.groups_only or args.speed_only else default_configuration(configs)  # shares and speed alone mark none
    cpus = parse_cpus(args.cpus)
    torch.set_num_threads(len(cpus))
    started = time.perf_counter()
    args.tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    items = eval_items(make_items("test", args.items, seed=args.seed, layout=args.layout), args.tokenizer)
    if args.quality_only:
        speed = {}
    elif args.speed_from:
        speed = earlier_speed(args.speed_from, args.layout)
    else:
        speed = measure_speed(args, all_axes, configs, items[:args.timed_items], full_reuse_host(configs, all_axes))
    speed_s = time.perf_counter() - started
    if args.speed_only:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "benchmark": "frontier --speed-only", "model_name": Path(args.model).name, "seed": args.seed,
            "layout": args.layout,
            "axes": {a.name: list(a.values) for a in all_axes}, "timed_items": args.timed_items, "cpus": cpus,
            "env": recorded_env(worker_env(cpus)), "seconds": round(speed_s, 1), "configurations": speed}, indent=2) + "\n")
        for name, row in speed.items():
            print(f"{name:32s} {row['speedup']:5.2f}x [{row['ci95'][0]:.2f}, {row['ci95'][1]:.2f}]  "
                  f"fused {row['decisions']['fused']}/{row['decisions']['requests']}")
        return 0
    done, offline = earlier_quality(args.quality_from or [], items, args.layout)
    quality_started = time.perf_counter()
    partial = args.out.with_suffix(".partial.json")

    def checkpoint(groups: dict, reports: dict) -> None:  # a long run keeps what it measured so far
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"benchmark": "frontier (partial quality)", "items": len(items),
                                       "quality": {"items": len(items), "layout": args.layout, "groups": {**done, **groups},
                                                   "offline": {**offline, **reports}}}) + "\n")

    quality, reports = measure_quality(args, all_axes, configs, items, done, checkpoint)
    offline.update(reports)
    if args.groups_only:
        checkpoint(quality, offline)
        partial.replace(args.out)
        return 0
    kinds = [i.kind for i in items]
    points = build_points(all_axes, configs, quality, speed, kinds, default, args.seed)
    reference = reference_group(all_axes)
    base = quality[reference]
    comparisons = paired_comparisons(quality, (base["full_prefill"], base["full_reuse"]), kinds, args.seed)
    sides = side_comparisons(quality, reference, (base["full_prefill"], base["full_reuse"]), kinds, args.seed)
    result = {
        "benchmark": "frontier", "model_name": Path(args.model).name, "seed": args.seed, "layout": args.layout,
        "quick": args.quick, "axes": {a.name: list(a.values) for a in all_axes},
        "targets_at": {"normalized_f1": TARGET_NORMALIZED_F1, "speedup": TARGET_SPEEDUP},
        "targets": {**targets(points), "query_aware_at_15": query_aware_target(comparisons, reference)},
        "defaults_mark": default_mark(default),
        "paired": comparisons,
        "paired_side_axes": sides,
        "quality": {"engine": "reference", "items": len(items), "split": "test", "layout": args.layout,
                    "kinds": {k: sum(i.kind == k for i in items) for k in ("single", "multi")},
                    "metric": "token F1", "max_new_tokens": MAX_NEW_TOKENS, "torch_threads": torch.get_num_threads(),
                    "side_settings": sorted(args.side_settings) if args.side_settings is not None else "all",
                    "reused_from": [p.name for p in args.quality_from or []] or None,
                    "seconds_measuring": round(time.perf_counter() - quality_started, 1),
                    "groups": quality, "offline": offline},
        "speed": None if args.quality_only else {
                  "engine": "vLLM in-process, CacheFuseConnector, one subprocess per engine group",
                  "timed_items": args.timed_items, "max_tokens": 1, "pairing": "plain then fused, back to back",
                  "cpus": cpus, "env": recorded_env(worker_env(cpus)), "reused_from": [str(p) for p in args.speed_from or []] or None,
                  "configurations": speed},
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "seconds": {"speed": round(speed_s, 1), "total": round(time.perf_counter() - started, 1)},
        "points": points}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    partial.unlink(missing_ok=True)
    if not args.quality_only:
        plot(result, args.out.with_suffix(".png"))
    print(table(result) if not args.quality_only else quality_table(result))
    print(comparison_table(comparisons + sides))
    print(json.dumps(result["targets"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

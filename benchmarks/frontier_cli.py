"""benchmarks/frontier.py's command line: its grid's default values and the parsing and checking of its flags
(imports only the standard library, cachefuse.testing.smollm2, for the model's default path, and
cachefuse.eval.qa_set's layouts), and the layout a result file was measured on."""

from __future__ import annotations

import argparse
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
SELECTORS = ("cacheblend", "epic", "cachecraft", "fusionrag", "qcfuse")
RATIOS = (0.05, 0.15, 0.30, 0.50, 0.70, 0.90)
RATIO_MODES = ("fixed", "controller")
QUICK = dict(items=4, timed_items=2, selectors="cacheblend,qcfuse", ratios="0.15,0.5")
MAX_NEW_TOKENS = 8
"""Greedy tokens per answer (token F1 over them)."""
FUSION = {"base": {"default_variant": "base"}, "fused": {"default_variant": "fused"}}
EXACT = {"on": {"exact_places": True}, "off": {"exact_places": False}}
"""The side axes' values (frontier.axes), the defaults' first."""
LAYOUT_BEFORE_LAYOUTS = "short"
"""What a result file without a layout measured: it was written before layouts, when the short one was all."""


def recorded_layout(record: dict) -> str:
    """The QA layout a result file (its top level, or its "quality" section) was measured on."""
    return record.get("layout", LAYOUT_BEFORE_LAYOUTS)


def check_layout(flag: str, path: Path, record: dict, layout: str) -> None:
    """Stops a run that would join `path` (read by `flag`) when it was measured on another layout than `layout`:
    scores and timings join only over the same prompts."""
    if recorded_layout(record) != layout:
        raise SystemExit(f"{flag} {path}: layout {recorded_layout(record)}, this run has {layout}")


def parse_args(argv=None) -> argparse.Namespace:
    import os

    from cachefuse.eval.qa_set import LAYOUTS
    from cachefuse.testing import smollm2

    parser = argparse.ArgumentParser(description="The quality / speed frontier (benchmarks/frontier.py).")
    parser.add_argument("--model", type=Path, default=smollm2.DEFAULT_DIR)
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK} unless given")
    parser.add_argument("--items", type=int, help="QA test items for quality (default 100)")
    parser.add_argument("--timed-items", type=int, help="of them, the first this many are timed (default 8)")
    parser.add_argument("--selectors", help=f"comma-separated (default {','.join(SELECTORS)})")
    parser.add_argument("--ratios", help=f"comma-separated (default {','.join(f'{r:g}' for r in RATIOS)})")
    parser.add_argument("--ratio-modes", default=",".join(RATIO_MODES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", choices=tuple(LAYOUTS), default="short",
                        help="the QA items' retrieved documents (cachefuse.eval.qa_set.LAYOUTS): "
                             + ", ".join(f"{name} {low}-{high}" for name, (low, high) in LAYOUTS.items()))
    parser.add_argument("--cpus", default=str(min(os.sched_getaffinity(0))),
                        help="CPUs every vLLM engine is bound to (default: one, the first this process may use: "
                             "on a shared machine one thread per engine keeps OpenMP's barriers from waiting on "
                             "descheduled threads); the reference engine runs as many torch threads")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per vLLM engine subprocess")
    parser.add_argument("--out", type=Path, default=BENCHMARKS.parent / "docs" / "benchmarks" / "frontier.json")
    parser.add_argument("--fusion", default=",".join(FUSION),
                        help="neighbour-fusion axis values (base: base entries; fused: default_variant fused over "
                             "neighbour-fused entries, stored offline for the items' documents)")
    parser.add_argument("--exact", default=",".join(EXACT), help="exact-places axis values (on, off)")
    parser.add_argument("--neighbours", type=int, default=10, help="N of the fusion axis's offline step (FusionRAG's 10)")
    parser.add_argument("--side-settings", default="cacheblend@0.15,qcfuse@0.15",
                        help="the settings the side axes' (fusion, exact) other values are measured with, "
                             "comma-separated selector@ratio (every side axis) or axis:selector@ratio "
                             "(fusion:qcfuse@0.05: that axis alone), or 'all'")
    parser.add_argument("--settings", help="keep only these selector@ratio settings of the selectors x ratios grid "
                                           "(comma-separated): a grid that is not a full product")
    parser.add_argument("--speed-from", type=Path, nargs="+",
                        help="reuse the TTFTs of earlier runs' JSONs (full runs' or --speed-only runs'; where two "
                             "timed a configuration, the later file's)")
    parser.add_argument("--quality-from", type=Path, nargs="+",
                        help="reuse the per-item quality of earlier runs' JSONs (same items; full, --quality-only or "
                             "their .partial.json checkpoints); only groups missing from them are measured")
    parser.add_argument("--groups-only", action="store_true",
                        help="measure the grid's quality groups and write only their per-item results (no points, "
                             "so the defaults need not be in the grid): one share of a long run split across "
                             "processes, joined with --quality-from")
    parser.add_argument("--groups", help="with --groups-only: only these quality groups (comma-separated, e.g. "
                                         "base/off,fused/on)")
    parser.add_argument("--quality-only", action="store_true",
                        help="score quality on the reference engine and write the JSON with no speed (no vLLM); "
                             "time later with --speed-only and join with --quality-from and --speed-from")
    parser.add_argument("--speed-only", action="store_true",
                        help="time every configuration through vLLM and stop (no quality, no plot): what each "
                             "ratio and selector can give at best, for grids too large to score")
    parser.add_argument("--replot", action="store_true", help="redraw the plot from --out")
    parser.add_argument("--ttft-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--ttft-result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = dict(items=100, timed_items=8, selectors=",".join(SELECTORS), ratios=",".join(map(str, RATIOS)))
    for name, value in (QUICK if args.quick else defaults).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not (args.quality_only or args.groups_only) and not 1 <= args.timed_items <= args.items:
        parser.error(f"--timed-items={args.timed_items}, expected 1..--items ({args.items})")
    args.selectors = tuple(s for s in args.selectors.split(",") if s)
    args.ratios = tuple(float(r) for r in args.ratios.split(",") if r)
    args.ratio_modes = tuple(m for m in args.ratio_modes.split(",") if m)
    args.fusion = tuple(v for v in args.fusion.split(",") if v)
    args.exact = tuple(v for v in args.exact.split(",") if v)
    for name, values, known in (("--fusion", args.fusion, FUSION), ("--exact", args.exact, EXACT)):
        if not values or values[0] != next(iter(known)) or not set(values) <= set(known):
            parser.error(f"{name}={','.join(values)!r}, expected {next(iter(known))!r} first (the full grid's value), "
                         f"then any of {', '.join(known)}")
    args.groups = None if args.groups is None else set(args.groups.split(","))
    if args.groups is not None and not args.groups_only:
        parser.error("--groups needs --groups-only (a frontier needs every group of its grid)")
    args.settings = None if args.settings is None else set(args.settings.split(","))
    args.side_settings_text = args.side_settings
    args.side_settings = None if args.side_settings == "all" else {s for s in args.side_settings.split(",") if s}
    for entry in args.side_settings or ():
        if ":" in entry and entry.split(":", 1)[0] not in ("fusion", "exact"):
            parser.error(f"--side-settings={args.side_settings_text!r}: in {entry!r} the axis before ':' is fusion or exact")
    args.quality_only = args.quality_only or args.groups_only
    if args.quality_only and (args.speed_only or args.speed_from):
        parser.error("--quality-only measures no speed: drop --speed-only / --speed-from")
    args.max_new_tokens = MAX_NEW_TOKENS
    return args

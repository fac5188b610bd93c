"""`cachefuse tune-alpha`: fit Cache-Craft's alpha on a validation set (Eq. 13; the work is cachefuse.eval.tune's).

    cachefuse tune-alpha --model DIR --data val.jsonl --floor F [--metric match|f1] [--alphas 0.25,0.5,1,2]
                         [--max-new-tokens N] [--no-warm] [--early-termination] [--config cachefuse.yaml]
                         [--json] [--no-progress]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cachefuse.cli.args import alpha_list, positive_int, unit_float
from cachefuse.config import CacheFuseConfig

NAME = "tune-alpha"
HELP = "fit Cache-Craft's alpha on a validation set (Eq. 13)"
DESCRIPTION = (
    "Runs the reference engine (transformers, in-memory store) on a validation set: stores base "
    "variants and, unless --no-warm, fused variants from one rotated-order pass per item; then per "
    "alpha fuses every item with the cachecraft selector and scores it against the full prefill "
    "(match) or the item's answer (f1). alpha* is the feasible alpha (quality >= --floor) with "
    "the lowest mean CFO. Exit status 1 when no alpha reaches the floor.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path, help="a local checkpoint directory (with its tokenizer)")
    p.add_argument("--data", required=True, type=Path,
                   help='JSONL file, one item per line: {"system": "...", "chunks": ["...", ...], "question": "...", '
                        '"answer": "..."} ("answer" needed by --metric f1 only)')
    p.add_argument("--floor", required=True, type=unit_float, help="the quality alpha* must reach, in 0..1")
    p.add_argument("--metric", choices=("match", "f1"), default="match",
                   help="match: greedy tokens equal to the full prefill's before the first divergence, / "
                        "--max-new-tokens; f1: LongBench token F1 of the greedy continuation against the answer "
                        "(default match)")
    p.add_argument("--alphas", type=alpha_list, default=(0.25, 0.5, 1.0, 2.0),
                   help="comma-separated candidate alphas in 0..100 (default 0.25,0.5,1,2)")
    p.add_argument("--max-new-tokens", type=positive_int, default=8, help="greedy tokens per item (default 8)")
    p.add_argument("--no-warm", action="store_true", help="base variants only (no fused variants from a warm pass)")
    p.add_argument("--early-termination", action="store_true",
                   help="tune with cachecraft_early_termination on (default off: quality then rises with alpha)")
    p.add_argument("--config", type=Path, default=None,
                   help="a cachefuse YAML config for the other fields (cachecraft_window, variant_admission_cfo, ...)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from cachefuse.chunks import model_fingerprint
    from cachefuse.eval import tune

    try:
        spec = tune.TuneSpec(alphas=args.alphas, floor=args.floor, metric=args.metric,
                             max_new_tokens=args.max_new_tokens, warm_variants=not args.no_warm,
                             early_termination=args.early_termination)
        items = tune.read_items_jsonl(args.data)
        tune.check_items(items, spec.metric)
        config = CacheFuseConfig() if args.config is None else CacheFuseConfig.from_yaml(args.config)
        model_fingerprint(args.model)  # a bad --model fails here, before the model loads
    except ValueError as exc:  # ConfigError included
        parser.error(str(exc))
    from cachefuse.eval.harness import reference_engine

    engine, tokenizer = reference_engine(args.model, config)
    try:
        tune.build_prompts(tokenizer, items)
    except ValueError as exc:
        parser.error(f"--data {str(args.data)!r}: {exc}")
    report = tune.tune_alpha(engine, tokenizer, items, spec, progress=not args.no_progress)
    print(json.dumps(report.to_dict(), indent=2) if args.json else tune.format_report(report))
    return 0 if report.alpha is not None else 1

"""`cachefuse profile-layers`: QCFuse's critical layers for a model (the work is cachefuse.offline.layer_profile's).

    cachefuse profile-layers --model DIR [--store DIR] [--out FILE] [--split validation] [--items 40]
                             [--seed 0] [--ratio 0.1] [--critical 3] [--view anchors|full]
                             [--plot FILE.png] [--config cachefuse.yaml] [--json] [--no-progress]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cachefuse.cli.args import check_output_file, check_store_dir, positive_int, unit_float
from cachefuse.config import CacheFuseConfig

NAME = "profile-layers"
HELP = "find QCFuse's critical layers for a model (Recall@10%% of answer tokens per layer)"
DESCRIPTION = (
    "Runs the reference engine (transformers, in-memory store) on the real-text QA set: for each prompt, "
    "the qcfuse question probe scores every cached context token at every layer, and each layer's "
    "Recall@ratio of the answer's tokens is averaged over the prompts. The best --critical layers are the "
    "profile's critical layers; with --store the profile is written under STORE/profiles/<model "
    "fingerprint>.json, where a vLLM engine on that store (qcfuse_critical_layers null) picks it up.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path, help="a local checkpoint directory (with its tokenizer)")
    p.add_argument("--store", type=Path, default=None,
                   help="the chunk store directory the profile serves (written to STORE/profiles/)")
    p.add_argument("--out", type=Path, default=None, help="also write the profile JSON here")
    p.add_argument("--plot", type=Path, default=None, help="also draw R(l) per layer and the top-k curve (PNG)")
    p.add_argument("--split", choices=("validation", "test"), default="validation",
                   help="QA split to profile on (default validation: the test split stays for evaluation)")
    p.add_argument("--items", type=positive_int, default=40, help="QA items (default 40)")
    p.add_argument("--seed", type=int, default=0, help="QA set seed (default 0)")
    p.add_argument("--ratio", type=unit_float, default=0.1, help="the Recall@ratio budget (default 0.1)")
    p.add_argument("--critical", type=positive_int, default=3, help="critical layers to keep (default 3)")
    p.add_argument("--view", choices=("anchors", "full"), default="anchors",
                   help="what the probe attends over: the chunks' anchors (qcfuse) or every cached row")
    p.add_argument("--config", type=Path, default=None,
                   help="a cachefuse YAML config (qcfuse_anchor_ratio, qcfuse_sink_tokens, ...)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from cachefuse.chunks import model_fingerprint

    if args.store is None and args.out is None:
        parser.error("--store or --out is required: where the profile is written")
    if args.ratio <= 0.0:
        parser.error(f"--ratio {args.ratio}: expected a budget above 0 (e.g. 0.1)")
    check_store_dir(parser, "--store", args.store)
    check_output_file(parser, "--out", args.out)
    check_output_file(parser, "--plot", args.plot)
    try:
        config = CacheFuseConfig() if args.config is None else CacheFuseConfig.from_yaml(args.config)
        model_fingerprint(args.model)  # a bad --model fails here, before the model loads
    except ValueError as exc:  # ConfigError included
        parser.error(str(exc))
    from cachefuse.eval.harness import reference_engine
    from cachefuse.eval.qa_set import answer_evidence_rows, eval_items, make_items
    from cachefuse.metadata.layer_profiles import profile_path, save_profile
    from cachefuse.offline.layer_profile import evidence_item, format_profile, plot_profile, profile_layers

    engine, tokenizer = reference_engine(args.model, config)
    qa = make_items(args.split, args.items, args.seed)
    items = []
    for item, eval_item in zip(qa, eval_items(qa, tokenizer), strict=True):
        prompt, rows = answer_evidence_rows(item, eval_item, tokenizer)
        items.append(evidence_item(prompt.token_ids, prompt.chunks, rows))
    try:
        profile = profile_layers(engine, items, ratio=args.ratio, num_critical=args.critical, view=args.view,
                                 progress=not args.no_progress)
    except ValueError as exc:
        parser.error(str(exc))
    written = [save_profile(profile, path) for path in
               ([profile_path(args.store, profile.fingerprint)] if args.store is not None else [])
               + ([args.out] if args.out is not None else [])]
    if args.plot is not None:
        written.append(plot_profile(profile, args.plot))
    print(json.dumps(profile.to_dict(), indent=1) if args.json else format_profile(profile))
    for path in written:
        print(f"written: {path}", file=sys.stderr if args.json else sys.stdout)
    return 0

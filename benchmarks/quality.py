"""Quality benchmark: every selector at every ratio on the RAG probe model, on held-out probe prompts.

    python benchmarks/quality.py --model models/rag-probe            # ~10-20 min on 2 CPU cores
    python benchmarks/quality.py --model models/rag-probe --test-items 200 --val-items 100   # a smoke run

Two splits of the probe task (cachefuse/eval/probe_task.py), drawn from seeds the training never
used: the validation split picks the best selector (highest exact match at the target ratio, 15%;
ties: lower mean KL), the test split reports every selector at ratios 0, 5, 10, 15, 20, 30, 50 and
100%, with exact match by kind (same-chunk, cross-chunk), the normalized score, McNemar tests against
full prefill and against cacheblend, and fidelity (cachefuse.eval.report). Also the probe's gate:
full-prefill EM on same-chunk questions, and full reuse's EM below full prefill's on cross-chunk ones.

Threads are pinned (`--threads`, default 2). Writes `--out` (JSON) and the plot next to it (.png).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cachefuse.config import CacheFuseConfig  # noqa: E402
from cachefuse.eval.harness import (  # noqa: E402
    DEFAULT_RATIOS,
    DEFAULT_SELECTORS,
    EvalSpec,
    probe_eval_items,
    reference_engine,
    run_eval,
)
from cachefuse.eval.report import best_selector, plot_report, probe_gate, summarize  # noqa: E402

VAL_SEED, TEST_SEED = 1, 2
TARGET_RATIO = 0.15


def target(summary: dict, best: str) -> dict:
    """Best selector at 15%: EM difference to full prefill (paired CI) and normalized EM; cacheblend beside it."""
    out = {}
    for name in dict.fromkeys([best, "cacheblend"]):
        entry = summary["settings"][f"{name}@{TARGET_RATIO:g}"]["by_kind"]
        out[name] = {kind: {"em": e["score"]["mean"], "vs_full_prefill": e["vs_full_prefill"],
                            "normalized": e["normalized"]} for kind, e in entry.items()}
    head = out[best]["all"]
    out["met"] = bool(head["vs_full_prefill"]["ci_low"] >= -0.01 and (head["normalized"] or 0.0) >= 0.9)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/rag-probe"))
    parser.add_argument("--val-items", type=int, default=400)
    parser.add_argument("--test-items", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/quality.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine, tokenizer = reference_engine(args.model, CacheFuseConfig())
    started = time.perf_counter()
    val_spec = EvalSpec(selectors=DEFAULT_SELECTORS, ratios=(TARGET_RATIO,))
    val = summarize(run_eval(engine, tokenizer, probe_eval_items(VAL_SEED, args.val_items), val_spec, desc="validation"))
    best = best_selector(val, TARGET_RATIO)
    test_runs = run_eval(engine, tokenizer, probe_eval_items(TEST_SEED, args.test_items),
                         EvalSpec(selectors=DEFAULT_SELECTORS, ratios=DEFAULT_RATIOS), desc="test")
    test = summarize(test_runs)
    report = {
        "benchmark": "quality", "model": str(args.model), "threads": args.threads,
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "splits": {"validation": {"seed": VAL_SEED, "items": args.val_items},
                   "test": {"seed": TEST_SEED, "items": args.test_items}},
        "best_selector": {"chosen_on": "validation", "ratio": TARGET_RATIO, "name": best,
                          "validation_em": {s["selector"]: s["by_kind"]["all"]["score"]["mean"]
                                            for s in val["settings"].values()}},
        "gate": probe_gate(test_runs), "target": target(test, best), "test": test,
        "seconds": round(time.perf_counter() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot_report(test, args.out.with_suffix(".png"), kind="cross_chunk",
                title=f"probe, {test['kinds']['cross_chunk']} cross-chunk test items (best on validation: {best})")
    print(json.dumps({"gate": report["gate"], "best_selector": best, "target": report["target"]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

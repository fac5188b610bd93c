"""Quality on real text: every selector at every ratio on SmolLM2-135M-Instruct, on the generated QA set.

    make model && python benchmarks/quality_qa.py                    # ~25 min on 2 CPU cores
    python benchmarks/quality_qa.py --val-items 4 --test-items 4     # a smoke run

The QA set (cachefuse/eval/qa_set.py) has single-document questions and two-hop questions whose
evidence sits mid-document in two documents, among distractors. The validation split picks the best
selector at 15% (highest token F1; ties: lower mean KL); the test split, which shares no entity with
it, reports full prefill, full reuse and every selector at ratios 0, 5, 10, 15, 20, 30, 50 and 100%,
with F1 by question kind, the normalized score, paired statistics against full prefill and
cacheblend, and fidelity (cachefuse.eval.report). Also the time of the fused prefill against the
full prefill on the same prompts, in this process (reference engine, `FusionStats.blend_time_s`).

Threads are pinned (`--threads`, default 2). Writes `--out` (JSON) and the plot next to it (.png).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
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
    reference_engine,
    run_eval,
    store_base_variants,
)
from cachefuse.eval.qa_set import eval_items, make_items  # noqa: E402
from cachefuse.eval.report import best_selector, plot_report, summarize  # noqa: E402
from cachefuse.rag_prompt import build_rag_prompt  # noqa: E402
from cachefuse.testing import smollm2  # noqa: E402

TARGET_RATIO = 0.15
MAX_NEW_TOKENS = 8


def prefill_times(engine, tokenizer, items, selector: str, repeats: int) -> dict:
    """Median blend time of full prefill and of `selector` at 15% per prompt, and their ratio (same process)."""
    full, fused = [], []
    for item in items:
        prompt = build_rag_prompt(tokenizer, item.system, item.chunks, item.question)
        store_base_variants(engine, prompt)
        for _ in range(repeats):
            _, stats = engine.prefill(prompt.token_ids, prompt.chunks, selector="full_prefill", ratio=1.0,
                                      save_holes=False, variants=[None] * len(prompt.chunks))
            full.append(stats.blend_time_s)
            _, stats = engine.prefill(prompt.token_ids, prompt.chunks, selector=selector, ratio=TARGET_RATIO,
                                      save_holes=False)
            fused.append(stats.blend_time_s)
    return {"selector": selector, "ratio": TARGET_RATIO, "prompts": len(items), "repeats": repeats,
            "full_prefill_s_median": statistics.median(full), "fused_s_median": statistics.median(fused),
            "speedup_median": statistics.median(full) / statistics.median(fused)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=smollm2.DEFAULT_DIR)
    parser.add_argument("--val-items", type=int, default=12)
    parser.add_argument("--test-items", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timing-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/quality_qa.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine, tokenizer = reference_engine(args.model, CacheFuseConfig())
    started = time.perf_counter()
    val_items = eval_items(make_items("validation", args.val_items), tokenizer)
    test_items = eval_items(make_items("test", args.test_items), tokenizer)
    val_spec = EvalSpec(selectors=DEFAULT_SELECTORS, ratios=(TARGET_RATIO,), metric="f1", max_new_tokens=MAX_NEW_TOKENS)
    val = summarize(run_eval(engine, tokenizer, val_items, val_spec, desc="validation"))
    best = best_selector(val, TARGET_RATIO)
    test_spec = EvalSpec(selectors=DEFAULT_SELECTORS, ratios=DEFAULT_RATIOS, metric="f1", max_new_tokens=MAX_NEW_TOKENS)
    test = summarize(run_eval(engine, tokenizer, test_items, test_spec, desc="test"))
    head = test["settings"][f"{best}@{TARGET_RATIO:g}"]["by_kind"]["all"]
    report = {
        "benchmark": "quality_qa", "model": str(args.model), "threads": args.threads,
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "metric": "f1", "max_new_tokens": MAX_NEW_TOKENS,
        "splits": {"validation": {"items": args.val_items}, "test": {"items": args.test_items}},
        "best_selector": {"chosen_on": "validation", "ratio": TARGET_RATIO, "name": best,
                          "validation_f1": {name: s["by_kind"]["all"]["score"]["mean"]
                                            for name, s in val["settings"].items()}},
        "target": {"normalized_f1": head["normalized"], "vs_full_prefill": head["vs_full_prefill"],
                   "goal": ">= 0.95 normalized F1 at 15%", "met": bool((head["normalized"] or 0.0) >= 0.95)},
        "prefill_time": prefill_times(engine, tokenizer, test_items[:4], best, args.timing_repeats),
        "test": test, "seconds": round(time.perf_counter() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot_report(test, args.out.with_suffix(".png"), kind="all",
                title=f"SmolLM2-135M, QA set, {args.test_items} test items, F1 (best on validation: {best})")
    print(json.dumps({"best_selector": best, "target": report["target"], "prefill_time": report["prefill_time"]},
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Selection choices at 15% on SmolLM2 and the QA set: each measured on validation, the best checked on test.

    make model && python benchmarks/selection_tuning.py                # ~15 min on 2 CPU cores
    python benchmarks/selection_tuning.py --val-items 4 --test-items 4 --out /tmp/tune.json   # a smoke run

What CacheBlend leaves open, one change from the default at a time (cacheblend: one check layer, 1, V
deviation): K or K+V deviation; the check layer deeper (4, 8, 15); several check layers with gradual
filtering (1, 8, 15 at 2x, 1.5x, 1x the ratio); each chunk's first 1 or 4 tokens always kept (attention
sinks, `cacheblend_sink_tokens`); a per-chunk minimum of half or all of each chunk's share
(`cacheblend_chunk_floor`); and the question-aware signals (qcfuse, fusionrag). Every setting
runs at `--ratio` (15%) on the validation split (token F1 of 8 greedy tokens, normalized between
full reuse and full prefill, KL to full prefill); the best by validation F1 is then run on the test
split beside the default, with a paired bootstrap test (cachefuse.eval.report). Reference engine,
every chunk loaded as its base variant, threads pinned (`--threads`). Writes `--out` (JSON) and a
bar plot beside it.
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
from cachefuse.eval import harness  # noqa: E402
from cachefuse.eval.harness import EvalSpec, reference_engine, run_eval  # noqa: E402
from cachefuse.eval.qa_set import eval_items, make_items  # noqa: E402
from cachefuse.eval.report import summarize  # noqa: E402
from cachefuse.testing import smollm2  # noqa: E402

MAX_NEW_TOKENS = 8
VARIANTS = {  # setting name -> (selector, config fields changed from the defaults)
    "cb_k": ("cacheblend", {"cacheblend_deviation": "k"}),
    "cb_kv": ("cacheblend", {"cacheblend_deviation": "kv"}),
    "cb_layer4": ("cacheblend", {"cacheblend_check_layers": (4,)}),
    "cb_layer8": ("cacheblend", {"cacheblend_check_layers": (8,)}),
    "cb_layer15": ("cacheblend", {"cacheblend_check_layers": (15,)}),
    "cb_gradual": ("cacheblend", {"cacheblend_check_layers": (1, 8, 15), "cacheblend_ratio_schedule": (2.0, 1.5, 1.0)}),
    "cb_sink1": ("cacheblend", {"cacheblend_sink_tokens": 1}),
    "cb_sink4": ("cacheblend", {"cacheblend_sink_tokens": 4}),
    "cb_floor50": ("cacheblend", {"cacheblend_chunk_floor": 0.5}),
    "cb_floor100": ("cacheblend", {"cacheblend_chunk_floor": 1.0}),
}
SETTINGS = ("cacheblend", *VARIANTS, "qcfuse", "fusionrag")


def headline(report: dict, names, ratio: float) -> dict:
    out = {}
    for name in names:
        entry = report["settings"][f"{name}@{ratio:g}"]
        own = entry["by_kind"]["all"]
        out[name] = {"f1": own["score"]["mean"], "normalized": own["normalized"],
                     "kl_mean": (entry.get("fidelity") or {}).get("kl_mean"), "vs_cacheblend": own.get("vs_cacheblend")}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 1]})
    val = result["validation"]
    names = list(val["settings"])
    left.bar(range(len(names)), [val["settings"][n]["f1"] for n in names], color="tab:blue")
    for value, style, label in ((val["full_prefill_f1"], "k--", "full prefill"), (val["full_reuse_f1"], "r:", "full reuse")):
        left.axhline(value, color=style[0], linestyle=style[1:], label=label)
    left.set_xticks(range(len(names)), names, rotation=35, ha="right")
    left.set(ylabel="token F1", title=f"validation, {val['items']} items, ratio {result['ratio']:g}")
    left.legend(loc="lower right")
    test = result["test"]
    tnames = list(test["settings"])
    right.bar(range(len(tnames)), [test["settings"][n]["f1"] for n in tnames], color="tab:orange")
    right.axhline(test["full_prefill_f1"], color="k", linestyle="--")
    right.axhline(test["full_reuse_f1"], color="r", linestyle=":")
    right.set_xticks(range(len(tnames)), tnames, rotation=35, ha="right")
    right.set(title=f"test, {test['items']} items")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def split_result(report: dict, names, ratio: float, items: int) -> dict:
    return {"items": items, "full_prefill_f1": report["settings"]["full_prefill"]["by_kind"]["all"]["score"]["mean"],
            "full_reuse_f1": report["settings"]["full_reuse"]["by_kind"]["all"]["score"]["mean"],
            "settings": headline(report, names, ratio), "report": report}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=smollm2.DEFAULT_DIR)
    parser.add_argument("--val-items", type=int, default=30)
    parser.add_argument("--test-items", type=int, default=30)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/smollm2/selection_tuning.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    harness.SELECTOR_VARIANTS.update(VARIANTS)  # the harness runs a variant as its selector under its fields
    engine, tokenizer = reference_engine(args.model, CacheFuseConfig())
    started = time.perf_counter()
    spec = EvalSpec(selectors=SETTINGS, ratios=(args.ratio,), metric="f1", max_new_tokens=MAX_NEW_TOKENS)
    val_items = eval_items(make_items("validation", args.val_items), tokenizer)
    validation = split_result(summarize(run_eval(engine, tokenizer, val_items, spec, desc="validation")),
                              SETTINGS, args.ratio, args.val_items)
    best = max(SETTINGS, key=lambda name: (validation["settings"][name]["f1"], name == "cacheblend"))
    chosen = ("cacheblend",) if best == "cacheblend" else ("cacheblend", best)
    test_spec = EvalSpec(selectors=chosen, ratios=(args.ratio,), metric="f1", max_new_tokens=MAX_NEW_TOKENS)
    test_items = eval_items(make_items("test", args.test_items), tokenizer)
    test = split_result(summarize(run_eval(engine, tokenizer, test_items, test_spec, desc="test")),
                        chosen, args.ratio, args.test_items)
    result = {"benchmark": "selection_tuning", "model": str(args.model), "threads": args.threads,
              "machine": {"platform": platform.platform(), "torch": torch.__version__},
              "ratio": args.ratio, "variants": {k: [s, {f: list(v) if isinstance(v, tuple) else v for f, v in c.items()}]
                                                 for k, (s, c) in VARIANTS.items()},
              "best_on_validation": best, "validation": validation, "test": test,
              "seconds": round(time.perf_counter() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({"best_on_validation": best,
                      "validation": {k: (round(v["f1"], 3), v["normalized"]) for k, v in validation["settings"].items()},
                      "test": {k: (round(v["f1"], 3), v["normalized"], v["vs_cacheblend"]) for k, v in test["settings"].items()}},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

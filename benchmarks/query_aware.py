"""Query-aware selectors (FusionRAG, QCFuse and its ablations) against CacheBlend on SmolLM2 and the QA set.

    make model && python benchmarks/query_aware.py                    # ~25 min on 2 CPU cores
    python benchmarks/query_aware.py --test-items 3 --ratios 0.15 --out /tmp/qa.json   # a smoke run

Test split of the QA set (cachefuse/eval/qa_set.py), reference engine, every chunk loaded as its base
variant (computed after the system prompt alone). Settings: full prefill, full reuse, and at each
`--ratios` cacheblend, fusionrag (final-layer question attention over the full loaded view), qcfuse
(anchors at r_a 0.1, the default critical layers, or a profile's with `--layer-profile`; anchors stored
offline by `--anchor-ranking`), qclast / qcall (the QCFuse demo's baselines: a question-only probe scored at
the last layer, the full loaded view scored at every layer; prophetkv is qcall's other name) and, with
`--selectors`, qcfuse_last / qcfuse_all (the anchor view scored at the last / every layer). Ratio 0 is full reuse and 1 full
prefill for all of them (tests/fusion/test_probe.py, tests/fusion/test_fusor.py), so they are not rerun.

Reports token F1 (8 greedy tokens) per setting with paired differences against cacheblend at the
same ratio (cachefuse.eval.report), fidelity to full prefill, and, at 15%, the selection overhead:
the probe's share of the fused prefill time and the fused time against full prefill on the same
prompts, medians over `--timing-repeats`, one process, threads pinned (`--threads`). Writes `--out`
(JSON) and a plot beside it.
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
from cachefuse.eval.harness import EvalSpec, reference_engine, run_eval, selector_at, store_base_variants  # noqa: E402
from cachefuse.eval.qa_set import eval_items, make_items  # noqa: E402
from cachefuse.eval.report import plot_report, summarize  # noqa: E402
from cachefuse.metadata.layer_profiles import LayerProfile  # noqa: E402
from cachefuse.rag_prompt import build_rag_prompt  # noqa: E402
from cachefuse.select.qcfuse import RANKINGS  # noqa: E402
from cachefuse.testing import smollm2  # noqa: E402

SELECTORS = ("cacheblend", "fusionrag", "qcfuse", "qclast", "qcall")
TARGET_RATIO = 0.15
MAX_NEW_TOKENS = 8


def overhead(engine, tokenizer, items, names, repeats: int) -> dict:
    """Per selector at 15%: median fused and probe time, the probe's share, and full prefill / fused."""
    full, fused = [], {name: [] for name in names}
    probe = {name: [] for name in names}
    for item in items:
        prompt = build_rag_prompt(tokenizer, item.system, item.chunks, item.question)
        store_base_variants(engine, prompt)
        for _ in range(repeats):
            _, stats = engine.prefill(prompt.token_ids, prompt.chunks, selector="full_prefill", ratio=1.0,
                                      save_holes=False, variants=[None] * len(prompt.chunks))
            full.append(stats.blend_time_s)
            for name in names:
                _, stats = engine.prefill(prompt.token_ids, prompt.chunks, ratio=TARGET_RATIO, save_holes=False,
                                          selector=selector_at(engine, name, TARGET_RATIO))
                fused[name].append(stats.blend_time_s)
                probe[name].append(stats.probe_time_s)
    full_s = statistics.median(full)
    return {"ratio": TARGET_RATIO, "prompts": len(items), "repeats": repeats, "full_prefill_s_median": full_s,
            "selectors": {name: {"fused_s_median": statistics.median(fused[name]),
                                 "probe_s_median": statistics.median(probe[name]),
                                 "probe_share_median": statistics.median(
                                     p / f for p, f in zip(probe[name], fused[name], strict=True)),
                                 "speedup_vs_full_prefill": full_s / statistics.median(fused[name])}
                          for name in names}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=smollm2.DEFAULT_DIR)
    parser.add_argument("--test-items", type=int, default=30)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.15, 0.3, 0.5])
    parser.add_argument("--selectors", nargs="+", default=list(SELECTORS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timing-items", type=int, default=4)
    parser.add_argument("--timing-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/smollm2/query_aware.json"))
    parser.add_argument("--layer-profile", type=Path, default=None,
                        help="a `cachefuse profile-layers --out` JSON: qcfuse scores at its critical layers")
    parser.add_argument("--anchor-ranking", choices=RANKINGS, default=None,
                        help="store QCFuse's anchors with each chunk offline, ranked this way (default: none "
                             "stored, key-norm anchors derived per request)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = CacheFuseConfig()
    if args.layer_profile is not None:
        profile = LayerProfile.from_dict(json.loads(args.layer_profile.read_text()))
        config = config.replace(qcfuse_critical_layers=profile.critical_layers)
    engine, tokenizer = reference_engine(args.model, config)
    started = time.perf_counter()
    items = eval_items(make_items("test", args.test_items), tokenizer)
    spec = EvalSpec(selectors=tuple(args.selectors), ratios=tuple(args.ratios), metric="f1",
                    max_new_tokens=MAX_NEW_TOKENS, anchor_ranking=args.anchor_ranking)
    test = summarize(run_eval(engine, tokenizer, items, spec, desc="test"))
    head = {}
    for name in args.selectors:
        entry = test["settings"].get(f"{name}@{TARGET_RATIO:g}")
        if entry is not None:
            own = entry["by_kind"]["all"]
            head[name] = {"f1": own["score"]["mean"], "normalized": own["normalized"],
                          "vs_cacheblend": own.get("vs_cacheblend")}
    report = {
        "benchmark": "query_aware", "model": str(args.model), "threads": args.threads,
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "num_layers": engine.adapter.shape.num_layers, "anchor_ranking": args.anchor_ranking,
        "qcfuse_score_layers": list(selector_at(engine, "qcfuse", TARGET_RATIO).probe_spec(
            engine.adapter.shape.num_layers).score_layers),
        "at_15": head,
        "overhead": overhead(engine, tokenizer, items[:args.timing_items], args.selectors, args.timing_repeats),
        "test": test, "seconds": round(time.perf_counter() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot_report(test, args.out.with_suffix(".png"), kind="all",
                title=f"SmolLM2-135M, QA set, {args.test_items} test items: query-aware selectors vs cacheblend")
    print(json.dumps({"at_15": head, "overhead": report["overhead"]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

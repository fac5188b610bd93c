"""Does `cachefuse eval --engine vllm` measure what the reference engine measures? SmolLM2, the QA set.

    make model && python benchmarks/engine_agreement.py                 # ~10 min on 2 CPU cores
    python benchmarks/engine_agreement.py --items 4 --out /tmp/agree.json   # a smoke run

The same items and settings (full prefill, full reuse, and each `--selectors` at each `--ratios`)
run through both engines in this process: the reference engine (transformers, cachefuse's fusor:
cachefuse.eval.harness) and a connector-enabled vLLM engine (cachefuse.eval.vllm_backend; its full
prefill is plain vLLM). Both store each document computed after the system prompt (the base
variant), both decode greedily. Per setting it reports each engine's mean token F1, the paired
difference (vLLM - reference) with its 95% bootstrap interval, how often the two engines give the
same answer text, and each engine's agreement with its own full prefill. "Agrees within noise" =
the interval of the paired difference contains 0.

The two engines run different kernels (vLLM's CPU attention and fused ops against transformers'
eager ones), so full prefill itself may differ in a few greedy tokens: that floor is reported as the
`full_prefill` row. Writes `--out` (JSON) and a plot next to it (.png).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cachefuse.config import CacheFuseConfig  # noqa: E402
from cachefuse.eval.harness import EvalSpec, reference_engine, run_eval  # noqa: E402
from cachefuse.eval.qa_set import eval_items, make_items  # noqa: E402
from cachefuse.eval.stats import mean_se, paired_bootstrap  # noqa: E402
from cachefuse.testing import smollm2  # noqa: E402


def compare(reference, vllm_runs) -> dict:
    """Per setting: both engines' scores, their paired difference and how often the answers match."""
    out = {}
    for name, ref_runs in reference.runs.items():
        vllm_setting = vllm_runs.runs[name]
        ref_scores, vllm_scores = [r.score for r in ref_runs], [r.score for r in vllm_setting]
        diff = paired_bootstrap(vllm_scores, ref_scores)
        out[name] = {
            "reference_f1": mean_se(ref_scores).to_dict(), "vllm_f1": mean_se(vllm_scores).to_dict(),
            "vllm_minus_reference": diff.to_dict(),
            "within_noise": diff.ci_low <= 0.0 <= diff.ci_high,
            "same_answer": statistics.mean(a.prediction.strip() == b.prediction.strip()
                                           for a, b in zip(ref_runs, vllm_setting, strict=True)),
            "reference_greedy_match": statistics.mean(r.greedy_match for r in ref_runs),
            "vllm_greedy_match": statistics.mean(r.greedy_match for r in vllm_setting),
            "reference_recompute_fraction": statistics.mean(r.recompute_fraction for r in ref_runs),
            "vllm_recompute_fraction": statistics.mean(r.recompute_fraction for r in vllm_setting),
        }
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["settings"])
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 4))
    width = 0.38
    for offset, engine, color in ((-width / 2, "reference", "tab:blue"), (width / 2, "vllm", "tab:orange")):
        means = [result["settings"][n][f"{engine}_f1"]["mean"] for n in names]
        errors = [result["settings"][n][f"{engine}_f1"]["se"] for n in names]
        ax.bar([i + offset for i in range(len(names))], means, width, yerr=errors, capsize=3, color=color,
               label=f"{engine} engine")
    for i, name in enumerate(names):
        setting = result["settings"][name]
        ax.annotate(f"same answer {setting['same_answer']:.0%}", (i, 0.02), ha="center", fontsize=7, rotation=90,
                    color="white")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("token F1 (mean +- SE)")
    ax.set_title(f"{result['model_name']}: reference engine vs vLLM, {result['items']} {result['split']} QA items")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=smollm2.DEFAULT_DIR)
    parser.add_argument("--split", choices=("validation", "test"), default="test")
    parser.add_argument("--items", type=int, default=30)
    parser.add_argument("--selectors", default="cacheblend,epic,random")
    parser.add_argument("--ratios", default="0.15")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/smollm2/engine_agreement.json"))
    parser.add_argument("--replot", action="store_true", help="redraw the plot from --out")
    args = parser.parse_args(argv)
    if args.replot:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return 0
    torch.set_num_threads(args.threads)
    spec = EvalSpec(selectors=tuple(s for s in args.selectors.split(",") if s),
                    ratios=tuple(float(r) for r in args.ratios.split(",")), metric="f1", max_new_tokens=8)
    started = time.perf_counter()
    engine, tokenizer = reference_engine(args.model, CacheFuseConfig())
    items = eval_items(make_items(args.split, args.items), tokenizer)
    reference = run_eval(engine, tokenizer, items, spec, desc="reference engine")
    del engine

    from cachefuse.eval.vllm_backend import run_eval_vllm
    from cachefuse.vllm.engines import connector_extra_config, connector_llm

    with tempfile.TemporaryDirectory(prefix="cachefuse-agreement-") as store:
        extra, config = connector_extra_config(Path(store), max_variants=10 * len(items) + 100)
        llm = connector_llm(args.model, extra, dtype="float32", max_model_len=2048)
        try:
            vllm_runs = run_eval_vllm(llm, items, spec, store_dir=config.store_path)
        finally:
            llm.llm_engine.engine_core.shutdown()
    result = {
        "benchmark": "engine_agreement", "model": str(args.model), "model_name": "SmolLM2-135M-Instruct",
        "split": args.split, "items": len(items), "metric": "f1", "max_new_tokens": spec.max_new_tokens,
        "threads": args.threads, "machine": platform.machine(),
        "settings": compare(reference, vllm_runs),
        "predictions": {name: {"reference": [r.prediction for r in reference.runs[name]],
                               "vllm": [r.prediction for r in vllm_runs.runs[name]]} for name in reference.runs},
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    for name, setting in result["settings"].items():
        diff = setting["vllm_minus_reference"]
        print(f"{name:<18} reference {setting['reference_f1']['mean']:.3f}  vllm {setting['vllm_f1']['mean']:.3f}  "
              f"diff {diff['diff']:+.3f} [{diff['ci_low']:+.3f}, {diff['ci_high']:+.3f}]  "
              f"same answer {setting['same_answer']:.0%}  {'within noise' if setting['within_noise'] else 'DIFFERS'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

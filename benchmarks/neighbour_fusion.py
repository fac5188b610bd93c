"""Neighbour fusion (FusionRAG's offline stage) on SmolLM2 and the QA set: which entry should a chunk load?

    make model && python benchmarks/neighbour_fusion.py                  # ~15 min on 2 CPU cores
    python benchmarks/neighbour_fusion.py --items 4 --out /tmp/nf.json   # a smoke run

The knowledge base is every document of `--items` test items of the QA set (deduplicated). The items
run once under full prefill, full reuse and each `--selectors` at 15% with every document stored as its
base variant (after the system prompt alone): the baseline. Then, per similarity retriever in
`--embedders` (`model`: the model's own mean-pooled hidden states; `lexical`: TF-IDF over token ids;
`cooccurrence`: an oracle, documents that share a prompt of the run), on a fresh store:

1. `fuse_neighbours` with `--neighbours` N: each document also stored computed after its N most similar
   documents (the offline cost per document is measured here);
2. the items run again under `default_variant: base` ("prefix-variant only": a chunk loads its neighbour
   variant only where Cache-Craft's scores prefer it, i.e. where enough of its neighbours precede it);
3. and under `default_variant: fused` ("fused everywhere", the paper's use): every chunk that is not first
   loads its neighbour variant unless a variant fits its prefix better.

Per setting: token F1 (8 greedy tokens), the normalized F1 (F1 - F1_full_reuse) / (F1_full_prefill -
F1_full_reuse) against the baseline's full prefill and full reuse (FusionRAG's Eq. 11), the paired
differences of F1, of normalized F1 and of KL with 95% bootstrap CIs (against the baseline, and fused everywhere
against prefix-variant only), first-token KL(full || fused) and top-1 agreement with full prefill, how
many chunks loaded a neighbour variant and their mean CFO; the offline cost per document in CPU seconds
of this process (so other work on the machine does not inflate it). Writes `--out` (JSON) and a plot beside it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cachefuse.config import CacheFuseConfig  # noqa: E402
from cachefuse.eval.fidelity import greedy_continuation, logits_kl  # noqa: E402
from cachefuse.eval.harness import METRICS, decode_text, selector_at, store_base_variants  # noqa: E402
from cachefuse.eval.metrics import best_score  # noqa: E402
from cachefuse.eval.qa_set import eval_items, make_items  # noqa: E402
from cachefuse.eval.stats import mean_se, paired_bootstrap  # noqa: E402
from cachefuse.offline.neighbours import fuse_neighbours, lexical_embedder, model_embedder  # noqa: E402
from cachefuse.rag_prompt import build_rag_prompt  # noqa: E402
from cachefuse.testing import smollm2  # noqa: E402

RATIO = 0.15
NEW_TOKENS = 8
MODES = {"prefix_only": "base", "fused_everywhere": "fused"}
"""Benchmark name -> config `default_variant`."""


def full_prefills(engine, tokenizer, prompts, items) -> dict:
    """Full prefill on every prompt: its last logits (the KL reference) and F1."""
    f1 = METRICS["f1"]
    out = {"logits": [], "f1": [], "kl": [], "top1": []}
    for prompt, item in zip(prompts, items, strict=True):
        result, _ = engine.prefill(prompt.token_ids, prompt.chunks, selector="full_prefill", ratio=1.0,
                                   save_holes=False, variants=[None] * len(prompt.chunks))
        answer = decode_text(tokenizer, greedy_continuation(engine.adapter, result, NEW_TOKENS))
        out["logits"].append(result.logits)
        out["f1"].append(best_score(f1, answer, item.answers))
        out["kl"].append(0.0)
        out["top1"].append(True)
    return out


def run_items(engine, tokenizer, prompts, items, settings, full, baseline=None) -> dict:
    """Every setting on every prompt (variants as the engine's config plans them); per setting the
    per-item figures, KL and top-1 against `full` (full_prefills). Given `baseline` (this function's result
    over base variants only), a prompt whose every chunk loads its base variant takes the baseline's figures
    instead of running again: the same K/V, selector and model give the same outputs."""
    from tqdm.auto import tqdm

    f1 = METRICS["f1"]
    out = {name: {"f1": [], "kl": [], "top1": [], "neighbour_chunks": [], "cfo": []} for name, _ in settings}
    with tqdm(total=len(prompts) * len(settings), desc="items", unit="prefill") as bar:
        for at, (prompt, item) in enumerate(zip(prompts, items, strict=True)):
            for name, ratio in settings:
                # cachecraft as deployed: its recompute follows each variant's CFO (no force_cfo)
                selector = name if name in ("full_reuse", "cachecraft") else selector_at(engine, name, ratio)
                choices = engine.plan_variants(prompt.token_ids, prompt.chunks)
                on_neighbours = sum(1 for c in choices[1:] if _prefix(engine, c))  # the system chunk is exact
                if baseline is not None and on_neighbours == 0:
                    for key, values in out[name].items():
                        values.append(baseline[name][key][at])
                    bar.update(1)
                    continue
                result, stats = engine.prefill(prompt.token_ids, prompt.chunks, selector=selector, ratio=ratio,
                                               save_holes=False, variants=choices)
                if stats.chunks_missed:
                    raise RuntimeError(f"{name}: {stats.chunks_missed} chunk(s) missed ({stats.miss_reasons})")
                answer = decode_text(tokenizer, greedy_continuation(engine.adapter, result, NEW_TOKENS))
                figures = out[name]
                figures["f1"].append(best_score(f1, answer, item.answers))
                figures["kl"].append(max(0.0, logits_kl(full["logits"][at], result.logits)))
                figures["top1"].append(bool(full["logits"][at].argmax() == result.logits.argmax()))
                figures["neighbour_chunks"].append(on_neighbours)
                figures["cfo"].append(statistics.mean(c.cfo for c in choices[1:]))
                bar.update(1)
    return out


def cooccurrence_embedder(prompts):
    """Per document, a one-hot row over the prompts that hold it: cosine > 0 exactly for documents
    that share a prompt, ties broken by document order (first seen first)."""

    def embed(chunks):
        where = {tuple(c): i for i, c in enumerate(chunks)}
        vectors = np.zeros((len(chunks), len(prompts)))
        for column, prompt in enumerate(prompts):
            for ids in prompt.chunk_token_ids[1:]:
                vectors[where[tuple(ids)], column] = 1.0
        return vectors

    return embed


def _prefix(engine, choice) -> tuple[str, ...]:
    """The prefix of the variant a choice loads (() for a base variant)."""
    return next((r.prefix for r in engine.metastore.variants(choice.chunk_key) if r.variant_id == choice.variant_id),
                ())


def normalized(f1: list[float], full: list[float], reuse: list[float]) -> float | None:
    """FusionRAG's Eq. 11 over the items: (F1 - F1_FR) / (F1_FA - F1_FR); None without a gap."""
    gap = float(np.mean(full) - np.mean(reuse))
    return None if gap <= 0.0 else (float(np.mean(f1)) - float(np.mean(reuse))) / gap


def paired_normalized(a: list[float], b: list[float], full: list[float], reuse: list[float],
                      num_resamples: int = 2000, seed: int = 0) -> dict:
    """Percentile 95% CI of normalized(a) - normalized(b), resampling the items jointly (seeded); resamples
    whose full-prefill-to-full-reuse gap is not positive are dropped (counted)."""
    arrays = [np.asarray(x, dtype=np.float64) for x in (a, b, full, reuse)]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(a), size=(num_resamples, len(a)))
    means = [x[picks].mean(axis=1) for x in arrays]  # [num_resamples] each
    gap = means[2] - means[3]
    kept = gap > 0
    diffs = (means[0][kept] - means[1][kept]) / gap[kept]
    observed_gap = arrays[2].mean() - arrays[3].mean()
    observed = (arrays[0].mean() - arrays[1].mean()) / observed_gap if observed_gap > 0 else None
    low, high = np.percentile(diffs, [2.5, 97.5]) if diffs.size else (float("nan"), float("nan"))
    far = np.sum(diffs <= 0.0) if (observed or 0.0) > 0 else np.sum(diffs >= 0.0)
    return {"diff": observed, "ci_low": float(low), "ci_high": float(high),
            "p_value": float(min(1.0, 2.0 * (far + 1) / (diffs.size + 1))), "resamples_dropped": int((~kept).sum())}


def summary(phase: dict, full: dict, reuse_f1: list[float]) -> dict:
    return {name: {"f1": mean_se(f["f1"]).to_dict(), "f1_normalized": normalized(f["f1"], full["f1"], reuse_f1),
                   "kl_mean": statistics.mean(f["kl"]), "kl_median": statistics.median(f["kl"]),
                   "top1_agree": statistics.mean(f["top1"]),
                   "chunks_on_neighbour_variants": sum(f.get("neighbour_chunks", [])),
                   "cfo_mean": statistics.mean(f["cfo"]) if f.get("cfo") else 0.0}
            for name, f in phase.items()}


def compare(a: dict, b: dict, full: dict, reuse_f1: list[float]) -> dict:
    """Per setting, a - b: F1 and first-token KL (paired bootstrap), normalized F1 (joint bootstrap)."""
    return {name: {"f1": paired_bootstrap(a[name]["f1"], b[name]["f1"]).to_dict(),
                   "f1_normalized": paired_normalized(a[name]["f1"], b[name]["f1"], full["f1"], reuse_f1),
                   "kl": paired_bootstrap(a[name]["kl"], b[name]["kl"]).to_dict()}
            for name in a}


def per_item(phase: dict) -> dict:
    """Per setting, the per-item F1 and KL (prompt order), for later paired analyses."""
    return {name: {"f1": f["f1"], "kl": [round(x, 6) for x in f["kl"]]} for name, f in phase.items()}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["baseline"]["settings"])
    embedders = list(result["retrievers"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    bars = [("base variants only", result["baseline"]["settings"], "tab:gray")]
    for embedder, color in zip(embedders, ("tab:blue", "tab:green", "tab:purple"), strict=False):
        runs = result["retrievers"][embedder]
        bars.append((f"{embedder}: prefix variant only", runs["prefix_only"], color))
        bars.append((f"{embedder}: fused everywhere", runs["fused_everywhere"], color))
    width = 0.8 / len(bars)
    for ax, key, label in ((axes[0], "f1", "token F1 (mean +- SE)"), (axes[1], "kl_mean", "KL(full || fused), mean")):
        for j, (legend, runs, color) in enumerate(bars):
            xs = [i - 0.4 + (j + 0.5) * width for i in range(len(names))]
            values = [runs[n]["f1"]["mean"] if key == "f1" else runs[n][key] for n in names]
            errors = [runs[n]["f1"]["se"] for n in names] if key == "f1" else None
            ax.bar(xs, values, width, yerr=errors, capsize=2, color=color, label=legend,
                   alpha=1.0 if "fused everywhere" in legend or j == 0 else 0.5,
                   hatch="//" if "fused everywhere" in legend else None)
        if key == "f1":
            ax.axhline(result["full_prefill"]["f1"]["mean"], color="black", linestyle="--", linewidth=1,
                       label="full prefill")
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M-Instruct, {result['items']} test QA items: neighbour-fused entries "
                 f"(N={result['neighbours']}), prefix variant only vs fused everywhere")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fused_store(args, prompts, tokenizer, embedder_name: str):
    """A fresh engine whose store holds every document's base variant and its neighbour variant."""
    from cachefuse.eval.harness import reference_engine

    engine, _ = reference_engine(args.model, CacheFuseConfig(max_variants=1 << 20))
    for prompt in prompts:
        store_base_variants(engine, prompt)
    documents = list({tuple(ids): None for p in prompts for ids in p.chunk_token_ids[1:]})
    system = prompts[0].chunk_token_ids[0]
    assert all(p.chunk_token_ids[0] == system for p in prompts), "every item shares the system prompt"
    embedder = {"model": lambda: model_embedder(engine), "lexical": lambda: lexical_embedder(len(tokenizer)),
                "cooccurrence": lambda: cooccurrence_embedder(prompts)}[embedder_name]()
    # CPU seconds of this process (one thread): the offline cost, whatever else the machine runs meanwhile
    report = fuse_neighbours(engine, system, [list(d) for d in documents], args.neighbours, embedder=embedder,
                             clock=time.process_time)
    offline = {"documents": len(documents), "stored": len(report.stored), "skipped": len(report.skipped),
               "failed": len(report.failed),
               "seconds_per_document_median": statistics.median(report.seconds) if report.seconds else None,
               "seconds_per_document_mean": statistics.mean(report.seconds) if report.seconds else None}
    return engine, offline


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=smollm2.DEFAULT_DIR)
    parser.add_argument("--items", type=int, default=30)
    parser.add_argument("--neighbours", type=int, default=10, help="N, the paper's default 10")
    parser.add_argument("--selectors", default="cacheblend")
    parser.add_argument("--embedders", default="model,lexical",
                        help="comma list of model (the served model's mean-pooled hidden states), lexical (TF-IDF over "
                             "token ids), cooccurrence (documents that share a prompt of this run: an oracle retriever "
                             "that knows the workload, the upper bound of the mechanism)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/smollm2/neighbour_fusion_default_variant.json"))
    parser.add_argument("--replot", action="store_true")
    args = parser.parse_args(argv)
    if args.replot:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return 0
    torch.set_num_threads(args.threads)
    from cachefuse.eval.harness import reference_engine

    started = time.perf_counter()
    engine, tokenizer = reference_engine(args.model, CacheFuseConfig(max_variants=1 << 20))
    items = eval_items(make_items("test", args.items), tokenizer)
    prompts = [build_rag_prompt(tokenizer, item.system, item.chunks, item.question) for item in items]
    for prompt in prompts:
        store_base_variants(engine, prompt)
    full = full_prefills(engine, tokenizer, prompts, items)
    settings = [("full_reuse", 0.0)] + [(s, RATIO) for s in args.selectors.split(",") if s]
    baseline = run_items(engine, tokenizer, prompts, items, settings, full)
    reuse_f1 = baseline["full_reuse"]["f1"]
    del engine

    retrievers = {}
    for embedder_name in [e for e in args.embedders.split(",") if e]:
        engine, offline = fused_store(args, prompts, tokenizer, embedder_name)
        phases = {}
        for mode, default_variant in MODES.items():
            engine.config = engine.config.replace(default_variant=default_variant)
            phases[mode] = run_items(engine, tokenizer, prompts, items, settings, full, baseline)
        retrievers[embedder_name] = {
            "offline": offline,
            **{mode: summary(phase, full, reuse_f1) for mode, phase in phases.items()},
            "per_item": {mode: per_item(phase) for mode, phase in phases.items()},
            "prefix_only_minus_baseline": compare(phases["prefix_only"], baseline, full, reuse_f1),
            "fused_everywhere_minus_baseline": compare(phases["fused_everywhere"], baseline, full, reuse_f1),
            "fused_everywhere_minus_prefix_only": compare(phases["fused_everywhere"], phases["prefix_only"], full,
                                                          reuse_f1),
        }
        del engine

    result = {
        "benchmark": "neighbour_fusion", "model": str(args.model), "items": len(items), "neighbours": args.neighbours,
        "threads": args.threads, "machine": platform.machine(), "recompute_ratio": RATIO,
        "full_prefill": {"f1": mean_se(full["f1"]).to_dict()},
        "baseline": {"settings": summary(baseline, full, reuse_f1), "per_item": per_item(baseline)},
        "full_prefill_f1_per_item": full["f1"],
        "retrievers": retrievers,
        "seconds": round(time.perf_counter() - started, 1), "cpu_seconds": round(time.process_time(), 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    for embedder_name, runs in retrievers.items():
        for name in result["baseline"]["settings"]:
            b = result["baseline"]["settings"][name]
            p, f = runs["prefix_only"][name], runs["fused_everywhere"][name]
            print(f"{embedder_name:<8} {name:<12} F1 {b['f1']['mean']:.3f} | prefix-only {p['f1']['mean']:.3f} "
                  f"({p['chunks_on_neighbour_variants']} chunks) | fused {f['f1']['mean']:.3f} "
                  f"({f['chunks_on_neighbour_variants']} chunks)   KL {b['kl_mean']:.3f} / {p['kl_mean']:.3f} / "
                  f"{f['kl_mean']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

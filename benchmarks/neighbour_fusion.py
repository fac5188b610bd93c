"""Neighbour fusion (FusionRAG's offline stage) on SmolLM2 and the QA set: do neighbour variants help?

    make model && python benchmarks/neighbour_fusion.py                  # ~15 min on 2 CPU cores
    python benchmarks/neighbour_fusion.py --items 4 --out /tmp/nf.json   # a smoke run

The knowledge base is every document of `--items` test items of the QA set (deduplicated). One
reference engine, one store, three phases:

1. every document stored as its base variant (after the system prompt alone); each item run under
   full prefill, full reuse and each `--selectors` at 15%: the baseline;
2. `fuse_neighbours` with `--neighbours` N (`--embedder model`: the model's own mean-pooled hidden
   states; `lexical`: TF-IDF over token ids; `cooccurrence`: an oracle retriever, documents that share
   a prompt of the run): each document also stored computed after its N most similar documents;
3. each item run again: every declared chunk loads the variant Cache-Craft scores best for its place
   in the prompt, which is a neighbour variant where the prompt holds enough of its neighbours.

Per setting: token F1 (8 greedy tokens), KL(full || fused) of the last token and top-1 agreement with
full prefill, in both phases, the paired F1 difference, how many chunks loaded a neighbour variant,
their mean CFO, and the offline cost per document. Writes `--out` (JSON) and a plot beside it.
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

from cachefuse.chunks import build_rag_prompt  # noqa: E402
from cachefuse.config import CacheFuseConfig  # noqa: E402
from cachefuse.eval.fidelity import greedy_continuation, logits_kl  # noqa: E402
from cachefuse.eval.harness import METRICS, decode_text, selector_at, store_base_variants  # noqa: E402
from cachefuse.eval.metrics import best_score  # noqa: E402
from cachefuse.eval.qa_set import eval_items, make_items  # noqa: E402
from cachefuse.eval.stats import mean_se, paired_bootstrap  # noqa: E402
from cachefuse.offline.neighbours import fuse_neighbours, lexical_embedder, model_embedder  # noqa: E402
from cachefuse.testing import smollm2  # noqa: E402

RATIO = 0.15
NEW_TOKENS = 8


def run_items(engine, tokenizer, prompts, items, settings) -> dict:
    """Every setting on every prompt (variants as planned); per setting the per-item figures."""
    from tqdm.auto import tqdm

    f1 = METRICS["f1"]
    out = {name: {"f1": [], "kl": [], "top1": [], "neighbour_chunks": [], "cfo": []} for name, _ in settings}
    with tqdm(total=len(prompts) * len(settings), desc="items", unit="prefill") as bar:
        for prompt, item in zip(prompts, items, strict=True):
            full = None
            for name, ratio in settings:
                if name == "full_prefill":
                    result, stats = engine.prefill(prompt.token_ids, prompt.chunks, selector="full_prefill",
                                                   ratio=1.0, save_holes=False, variants=[None] * len(prompt.chunks))
                    full = result
                else:
                    # cachecraft as deployed: its recompute follows each variant's CFO (no force_cfo)
                    selector = name if name in ("full_reuse", "cachecraft") else selector_at(engine, name, ratio)
                    choices = engine.plan_variants(prompt.token_ids, prompt.chunks)
                    result, stats = engine.prefill(prompt.token_ids, prompt.chunks, selector=selector, ratio=ratio,
                                                   save_holes=False, variants=choices)
                    if stats.chunks_missed:
                        raise RuntimeError(f"{name}: {stats.chunks_missed} chunk(s) missed ({stats.miss_reasons})")
                answer = decode_text(tokenizer, greedy_continuation(engine.adapter, result, NEW_TOKENS))
                figures = out[name]
                figures["f1"].append(best_score(f1, answer, item.answers))
                figures["kl"].append(max(0.0, logits_kl(full.logits, result.logits)))
                figures["top1"].append(bool(full.logits.argmax() == result.logits.argmax()))
                if name != "full_prefill":
                    retrieved = choices[1:]  # the system chunk is always exact
                    figures["neighbour_chunks"].append(sum(1 for c in retrieved if _prefix(engine, c)))
                    figures["cfo"].append(statistics.mean(c.cfo for c in retrieved))
                bar.update(1)
    return out


def cooccurrence_embedder(prompts):
    """Per document, a one-hot row over the prompts that hold it: cosine > 0 exactly for documents
    that share a prompt, ties broken by document order (first seen first)."""
    import numpy as np

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


def summary(phase: dict) -> dict:
    return {name: {"f1": mean_se(f["f1"]).to_dict(), "kl_mean": statistics.mean(f["kl"]),
                   "top1_agree": statistics.mean(f["top1"]),
                   "chunks_on_neighbour_variants": sum(f["neighbour_chunks"]),
                   "cfo_mean": statistics.mean(f["cfo"]) if f["cfo"] else 0.0}
            for name, f in phase.items()}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in result["base"] if n != "full_prefill"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "f1", "token F1 (mean +- SE)"), (axes[1], "kl_mean", "KL(full || fused), mean")):
        for offset, phase, color in ((-0.2, "base", "tab:gray"), (0.2, "fused", "tab:green")):
            values = [result[phase][n][key]["mean"] if key == "f1" else result[phase][n][key] for n in names]
            errors = [result[phase][n]["f1"]["se"] for n in names] if key == "f1" else None
            ax.bar([i + offset for i in range(len(names))], values, 0.4, yerr=errors, capsize=3, color=color,
                   label="base variants only" if phase == "base" else f"+ neighbour variants (N={result['neighbours']})")
        if key == "f1":
            ax.axhline(result["base"]["full_prefill"]["f1"]["mean"], color="black", linestyle="--", linewidth=1,
                       label="full prefill")
        ax.set_xticks(range(len(names)), names, rotation=15)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct, {result['items']} test QA items: neighbour fusion "
                 f"({result.get('embedder', 'model')} embedder)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=smollm2.DEFAULT_DIR)
    parser.add_argument("--items", type=int, default=30)
    parser.add_argument("--neighbours", type=int, default=3)
    parser.add_argument("--selectors", default="cacheblend,cachecraft")
    parser.add_argument("--embedder", choices=("model", "lexical", "cooccurrence"), default="model",
                        help="model: the served model's mean-pooled hidden states; lexical: TF-IDF over token ids; "
                             "cooccurrence: documents that share a prompt of this run (an oracle retriever that "
                             "knows the workload: the upper bound of the mechanism)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/smollm2/neighbour_fusion.json"))
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
    settings = [("full_prefill", 1.0), ("full_reuse", 0.0)] + [(s, RATIO) for s in args.selectors.split(",") if s]
    base = run_items(engine, tokenizer, prompts, items, settings)

    documents = list({tuple(ids): None for p in prompts for ids in p.chunk_token_ids[1:]})
    system = prompts[0].chunk_token_ids[0]
    assert all(p.chunk_token_ids[0] == system for p in prompts), "every item shares the system prompt"
    embedder = {"model": lambda: model_embedder(engine), "lexical": lambda: lexical_embedder(len(tokenizer)),
                "cooccurrence": lambda: cooccurrence_embedder(prompts)}[args.embedder]()
    report = fuse_neighbours(engine, system, [list(d) for d in documents], args.neighbours, embedder=embedder)
    fused = run_items(engine, tokenizer, prompts, items, settings)

    result = {
        "benchmark": "neighbour_fusion", "model": str(args.model), "items": len(items), "neighbours": args.neighbours,
        "embedder": args.embedder,
        "documents": len(documents), "threads": args.threads, "machine": platform.machine(),
        "offline": {"stored": len(report.stored), "skipped": len(report.skipped), "failed": len(report.failed),
                    "seconds_per_document_median": statistics.median(report.seconds) if report.seconds else None},
        "base": summary(base), "fused": summary(fused),
        "f1_fused_minus_base": {name: paired_bootstrap(fused[name]["f1"], base[name]["f1"]).to_dict()
                                for name in base if name != "full_prefill"},
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    for name in base:
        b, f = result["base"][name], result["fused"][name]
        print(f"{name:<14} F1 {b['f1']['mean']:.3f} -> {f['f1']['mean']:.3f}   KL {b['kl_mean']:.3f} -> "
              f"{f['kl_mean']:.3f}   chunks on neighbour variants {f['chunks_on_neighbour_variants']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

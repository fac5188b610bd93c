"""How far can choosing rows go on SmolLM2? Oracle selections beside the real selectors, per ratio.

    make model && python benchmarks/selection_bound.py              # ~26 min on 2 CPU cores
    python benchmarks/selection_bound.py --items 3 --out /tmp/bound.json   # a smoke run
    python benchmarks/selection_bound.py --ratios 0.7 0.9 --no-oracles \
        --out docs/benchmarks/smollm2/selection_bound_high.json          # where the selectors get to 0.95

The 0.95 normalized F1 at 15% that CacheBlend reports on 7B+ models is the real-model issue's target;
on SmolLM2-135M no selector came near it (docs/selectors.md). This asks whether *any* choice of rows
could: oracles that know the full prefill choose the rows, and the fused pass then recomputes exactly
those rows (FixedSelector), under the same rules as every selector (forced rows on top, exact mask):

- `oracle_kv`: the rows whose loaded K/V deviate most from the full prefill's, summed over every
  layer (each layer's squared K and V distances divided by their mean over the candidates, so every
  layer and both of K and V weigh alike): HKVD with perfect knowledge of every layer, not one check
  layer's estimate. Two full layers first, as CacheBlend's default runs.
- `oracle_attention`: the rows the full prefill's last token attends to most, summed over heads and
  layers: what the question-aware selectors estimate with a probe. No full layer, as they run.
- `oracle_evidence`: the rows where the answer is written in the documents (every occurrence), then
  the highest `oracle_kv` rows up to the ratio: the answer's own tokens always recomputed.

Beside them the default `cacheblend` and `qcfuse`, at 5/15/30/50%. Items come from the validation and
test splits (no choice is made on them). Token F1 of 8 greedy tokens and KL(full || fused) of the
first token; normalized F1 = (F1 - full reuse) / (full prefill - full reuse) over all items. Writes
`--out` (JSON) and a plot beside it.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cachefuse.config import CacheFuseConfig  # noqa: E402
from cachefuse.eval.harness import (  # noqa: E402
    EvalSpec,
    fresh_store,
    full_prefill,
    last_token_attention,
    measure_run,
    reference_engine,
    selector_at,
    store_base_variants,
)
from cachefuse.eval.qa_set import answer_evidence_rows, eval_items, make_items  # noqa: E402
from cachefuse.eval.stats import mean_se, normalized_score, paired_bootstrap  # noqa: E402
from cachefuse.rag_prompt import build_rag_prompt  # noqa: E402
from cachefuse.select.base import num_rows_for_ratio  # noqa: E402
from cachefuse.select.fixed import FixedSelector  # noqa: E402
from cachefuse.testing import smollm2  # noqa: E402

MAX_NEW_TOKENS = 8
RATIOS = (0.05, 0.15, 0.30, 0.50)
SELECTORS = ("cacheblend", "qcfuse")
ORACLES = ("oracle_kv", "oracle_attention", "oracle_evidence")
CACHEBLEND_FULL_LAYERS = 2  # layers 0 and 1, as the default check layer 1 computes them


def candidate_rows(prompt) -> torch.Tensor:
    """Rows of the declared non-system chunks: what a ratio counts (docs/selectors.md)."""
    return torch.cat([torch.arange(start, end) for start, end in prompt.chunks if start != 0])


def kv_oracle_scores(reuse, full, rows: torch.Tensor) -> torch.Tensor:
    """[len(rows)]: every layer's squared K and V distance between the loaded (full reuse) and the full
    prefill's rows, each divided by its mean over the rows, summed."""
    score = torch.zeros(rows.numel())
    for k_reuse, v_reuse, k_full, v_full in zip(reuse.k, reuse.v, full.k, full.v, strict=True):
        for loaded, exact in ((k_reuse, k_full), (v_reuse, v_full)):
            distance = (loaded[rows].float() - exact[rows].float()).pow(2).sum(dim=(1, 2))
            score += distance / distance.mean().clamp_min(1e-30)
    return score


def attention_oracle_scores(attention: dict[int, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """[len(rows)]: the full prefill's last-token attention to each row, summed over heads and layers."""
    return sum(weights[:, rows].sum(dim=0) for weights in attention.values())


def top_rows(rows: torch.Tensor, score: torch.Tensor, count: int, first: tuple[int, ...] = ()) -> list[int]:
    """`first` (those among `rows`, up to `count`), then the highest-scoring rows up to `count`."""
    candidates = rows.tolist()
    allowed = set(candidates)
    chosen = [r for r in first if r in allowed][:count]
    taken = set(chosen)
    for index in torch.argsort(score, descending=True, stable=True).tolist():
        if len(chosen) >= count:
            break
        if candidates[index] not in taken:
            chosen.append(candidates[index])
            taken.add(candidates[index])
    return chosen


def run_item(engine, tokenizer, qa_item, item, spec: EvalSpec, ratios=RATIOS, oracles=True) -> dict[str, dict]:
    prompt = build_rag_prompt(tokenizer, item.system, item.chunks, item.question)
    _, evidence = answer_evidence_rows(qa_item, item, tokenizer)
    fresh_store(engine)
    store_base_variants(engine, prompt)
    out = {}

    def measure(name, result, reference):
        run, reference = measure_run(engine, tokenizer, item, spec, prompt, result, reference)
        out[name] = {"f1": run.score, "kl": run.kl, "prediction": run.prediction,
                     "recompute_fraction": run.recompute_fraction}
        return reference

    full = full_prefill(engine, prompt)
    reference = measure("full_prefill", full, None)
    reuse, _ = engine.prefill(prompt.token_ids, prompt.chunks, selector="full_reuse", ratio=0.0, save_holes=False)
    measure("full_reuse", reuse, reference)
    rows = candidate_rows(prompt)
    kv_score = kv_oracle_scores(reuse, full, rows)
    layers = range(engine.adapter.shape.num_layers)
    attention = last_token_attention(engine, full, prompt.token_ids[-1], layers)
    attention_score = attention_oracle_scores(attention, rows)
    for ratio in ratios:
        count = num_rows_for_ratio(ratio, rows.numel())
        for name in SELECTORS:
            result, stats = engine.prefill(prompt.token_ids, prompt.chunks, selector=selector_at(engine, name, ratio),
                                           ratio=ratio, save_holes=False)
            assert not stats.chunks_missed, stats.miss_reasons
            measure(f"{name}@{ratio:g}", result, reference)
        if not oracles:
            continue
        chosen = {"oracle_kv": FixedSelector(top_rows(rows, kv_score, count), CACHEBLEND_FULL_LAYERS),
                  "oracle_attention": FixedSelector(top_rows(rows, attention_score, count), 0),
                  "oracle_evidence": FixedSelector(top_rows(rows, kv_score, count, evidence), CACHEBLEND_FULL_LAYERS)}
        for name, selector in chosen.items():
            result, _ = engine.prefill(prompt.token_ids, prompt.chunks, selector=selector, ratio=ratio,
                                       save_holes=False)
            measure(f"{name}@{ratio:g}", result, reference)
    out["_evidence_rows"] = {"count": len(evidence), "candidates": int(rows.numel())}
    return out


def summarize(per_item: list[dict]) -> dict:
    names = [name for name in per_item[0] if not name.startswith("_")]
    prefill = [item["full_prefill"]["f1"] for item in per_item]
    reuse = [item["full_reuse"]["f1"] for item in per_item]
    gap = mean_se([p - r for p, r in zip(prefill, reuse, strict=True)])
    settings = {}
    for name in names:
        f1 = [item[name]["f1"] for item in per_item]
        kl = [item[name]["kl"] for item in per_item]
        vs_prefill = paired_bootstrap(f1, prefill) if name != "full_prefill" else None
        settings[name] = {"f1": mean_se(f1).mean, "f1_se": mean_se(f1).se, "kl_mean": float(np.mean(kl)),
                          "kl_median": float(np.median(kl)), "normalized": normalized_score(float(np.mean(f1)), prefill, reuse),
                          "vs_full_prefill": None if vs_prefill is None else
                          {"diff": vs_prefill.diff, "low": vs_prefill.ci_low, "high": vs_prefill.ci_high, "p": vs_prefill.p_value}}
    return {"items": len(per_item), "gap": {"mean": gap.mean, "se": gap.se}, "settings": settings}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings, ratios = result["summary"]["settings"], result["ratios"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in (*SELECTORS, *(ORACLES if result["oracles"] else ())):
        xs = [100 * r for r in ratios]
        left.plot(xs, [settings[f"{name}@{r:g}"]["f1"] for r in ratios], marker="o", label=name,
                  linestyle="--" if name.startswith("oracle") else "-")
        right.plot(xs, [settings[f"{name}@{r:g}"]["kl_mean"] for r in ratios], marker="o", label=name,
                   linestyle="--" if name.startswith("oracle") else "-")
    for axis, key in ((left, "f1"), (right, "kl_mean")):
        axis.axhline(settings["full_prefill"][key], color="k", linestyle=":", label="full prefill")
        axis.axhline(settings["full_reuse"][key], color="r", linestyle=":", label="full reuse")
        axis.set_xlabel("recompute ratio (%)")
    left.axhline(settings["full_reuse"]["f1"] + 0.95 * result["summary"]["gap"]["mean"], color="g", linestyle="-.",
                 label="0.95 normalized")
    left.set(ylabel="token F1", title=f"SmolLM2-135M, {result['summary']['items']} QA items")
    right.set(ylabel="KL(full || fused), mean", yscale="log", title="first-token fidelity")
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    from tqdm.auto import tqdm

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=smollm2.DEFAULT_DIR)
    parser.add_argument("--items", type=int, default=30, help="per split (validation and test)")
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    parser.add_argument("--no-oracles", action="store_true", help="the real selectors only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/smollm2/selection_bound.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine, tokenizer = reference_engine(args.model, CacheFuseConfig())
    spec = EvalSpec(selectors=(), ratios=(), metric="f1", max_new_tokens=MAX_NEW_TOKENS)
    started = time.perf_counter()
    qa_items = make_items("validation", args.items) + make_items("test", args.items)
    items = eval_items(qa_items, tokenizer)
    per_item = [run_item(engine, tokenizer, qa, item, spec, args.ratios, not args.no_oracles)
                for qa, item in tqdm(list(zip(qa_items, items, strict=True)), desc="selection bound", unit="item")]
    summary = summarize(per_item)
    result = {"benchmark": "selection_bound", "model": str(args.model), "threads": args.threads,
              "machine": {"platform": platform.platform(), "torch": torch.__version__},
              "ratios": args.ratios, "oracles": not args.no_oracles, "max_new_tokens": MAX_NEW_TOKENS,
              "summary": summary,
              "kinds": [qa.kind for qa in qa_items], "per_item": per_item,
              "seconds": round(time.perf_counter() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({name: (round(s["f1"], 3), None if s["normalized"] is None else round(s["normalized"], 2),
                             round(s["kl_mean"], 3)) for name, s in summary["settings"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Cache-Craft as deployed on SmolLM2-135M-Instruct: variants admitted from served requests, CFO driving recompute.

    make model && python benchmarks/cachecraft_variants.py --threads 1      # ~10 min on one idle CPU core
    python benchmarks/cachecraft_variants.py --items 3 --rounds 2 --out /tmp/cv.json   # a smoke run

The workload is Cache-Craft's setting: the same documents recur across requests after related
prefixes. Each QA item (cachefuse/eval/qa_set.py, test split) is asked once per round; every ask sends
its evidence documents and all but one of its distractors (a different one left out each time), in
the item's retrieval order with one random adjacent swap half the time. Requests arrive round-robin
over the items, so a chunk comes back a few requests later after a prefix that shares most of its
chunks, in mostly the same order.

```
round 0:  | system | d3 d1 d4 d2 | question |     d0 left out
round 1:  | system | d0 d3 d4 d2 | question |     d1 left out, d1/d4 swapped ...
```

Served: one engine with `selector: cachecraft` and every other field at its default (alpha 1, early
termination on, admission at CFO >= 0.5, one chunk per request), whose store starts with the base
variants `cachefuse precompute` writes; requests run in sequence and whatever the policy admits is
saved (with attention statistics) before the next request. No `force_cfo`: each chunk recomputes
ceil(CFO x |C|) of its tokens, CFO from the variant it chose.

Measured over the later rounds (`--measure-from`), on the same prompts: the served run; cachecraft
with admission off (base variants only: every non-first chunk at CFO 0.5, what deployments had before
admission); cacheblend on base variants with each request at the ratio that recomputes what the
served run recomputed for it (labelled by the mean ratio); full reuse; full prefill (the reference for KL and top-1). The recompute fraction is the share of the
retrieved chunks' tokens computed, averaged over layers: chunks admitted (computed in full) count in
full, and cacheblend's full layers count. Also the variants created and the chosen CFOs.

Admission under other selectors (`admission` in the JSON, one entry per `--admission-selectors`, by
default cacheblend and qcfuse): for each, the same stream served by two more engines from the same store
start, the selector at its default ratio with admission on (threshold 0.5 = alpha / 2, one chunk per
request, no attention statistics: their default) and with it off; and the selector with admission off,
each request at the ratio that recomputes what admission on recomputed for it (the same compute, spent on
the selector's rows instead of a chunk in full). Paired differences (on - other) of F1, first-token KL,
greedy match and recompute fraction over the measured requests, the measured rounds one by one, and both
streams per round (recompute, chunks and tokens admitted).

Threads are pinned (`--threads`); quality does not depend on them, and nothing here is a speed figure.
Writes `--out` (JSON) and the plot next to it (.png; `--replot` redraws it from the JSON).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cachefuse.config import CacheFuseConfig  # noqa: E402
from cachefuse.eval.harness import (  # noqa: E402
    EvalItem,
    EvalRuns,
    EvalSpec,
    full_prefill,
    measure_run,
    reference_engine,
    setting_name,
    store_base_variants,
)
from cachefuse.eval.qa_set import eval_items, make_items  # noqa: E402
from cachefuse.eval.report import fidelity, summarize  # noqa: E402
from cachefuse.eval.stats import mean_se, paired_diff  # noqa: E402
from cachefuse.rag_prompt import RagPrompt, build_rag_prompt  # noqa: E402
from cachefuse.testing import smollm2  # noqa: E402

MAX_NEW_TOKENS = 8


def make_stream(qa_items, items: list[EvalItem], rounds: int, seed: int) -> list[tuple[int, EvalItem]]:
    """(round, request) in arrival order: each item once per round, round-robin; one distractor left out
    (a different one each round), one random adjacent swap half the time."""
    rng = random.Random(seed)
    stream = []
    for round_ in range(rounds):
        for qa, item in zip(qa_items, items, strict=True):
            distractors = [i for i in range(len(item.chunks)) if i not in qa.evidence]
            left_out = distractors[(round_ + rng.randrange(len(distractors))) % len(distractors)]
            order = [i for i in range(len(item.chunks)) if i != left_out]
            if rng.random() < 0.5:
                j = rng.randrange(len(order) - 1)
                order[j], order[j + 1] = order[j + 1], order[j]
            stream.append((round_, EvalItem(item.system, tuple(item.chunks[i] for i in order), item.question,
                                            item.answers, item.kind)))
    return stream


def chunk_fraction(result, prompt: RagPrompt) -> float:
    """Share of the retrieved chunks' tokens computed, averaged over layers (a chunk computed in full counts
    in full; the system chunk and the question do not count)."""
    mask = torch.zeros(len(prompt.token_ids), dtype=torch.bool)
    for start, end in prompt.chunks:
        mask[start:end] = start != 0  # the chunk at offset 0 is the system chunk
    per_layer = [int(mask.sum()) if rows is None else int(mask[rows].sum()) for rows in result.rows_per_layer]
    return statistics.fmean(per_layer) / int(mask.sum())


def serve(engine, tokenizer, stream, spec: EvalSpec, measure_from: int, bar, references=None) -> dict:
    """The served stream: every request fused as configured, its admitted chunks saved before the next.
    `references`: the measured requests' full prefills from an earlier serve of the same stream (None:
    computed here)."""
    out = {"runs": [], "fractions": [], "cfo": [], "per_round": {}, "saved": 0, "references": [],
           "measure_from": measure_from, "base_variants": engine.metastore.count(), "rounds": [],
           "admitted_tokens": []}
    measured = iter(references) if references is not None else None
    for round_, item in stream:
        prompt = build_rag_prompt(tokenizer, item.system, item.chunks, item.question)
        result, stats = engine.prefill(prompt.token_ids, prompt.chunks, save_inline=True)
        fraction = chunk_fraction(result, prompt)
        retrieved_cfo = stats.chunk_cfo[1:]  # [0] is the system chunk
        row = out["per_round"].setdefault(round_, {"fraction": [], "admitted": 0, "cfo": [], "admitted_tokens": []})
        row["fraction"].append(fraction)
        row["admitted"] += sum(c is None for c in retrieved_cfo)
        row["admitted_tokens"].append(sum(end - start for (start, end), c in zip(prompt.chunks[1:], retrieved_cfo,
                                                                                 strict=True) if c is None))
        row["cfo"] += [c for c in retrieved_cfo if c is not None]
        out["saved"] += stats.holes_saved
        if round_ >= measure_from:
            if measured is None:
                _, reference = measure_run(engine, tokenizer, item, spec, prompt, full_prefill(engine, prompt))
            else:
                reference = next(measured)
            run, _ = measure_run(engine, tokenizer, item, spec, prompt, result, reference)
            out["runs"].append(run)
            out["references"].append(reference)
            out["fractions"].append(fraction)
            out["rounds"].append(round_)
            out["admitted_tokens"].append(row["admitted_tokens"][-1])
            out["cfo"] += [("admitted" if c is None else round(c, 4)) for c in retrieved_cfo]
        bar.update(1)
    return out


def baselines(engine, tokenizer, measured, references, spec: EvalSpec, bar) -> dict:
    """On base variants only (nothing saved): full prefill and full reuse, cachecraft with admission off."""
    settings = {"full_prefill": ("full_prefill", 1.0), "full_reuse": ("full_reuse", 0.0),
                "cachecraft_no_admission": ("cachecraft", 0.15)}
    no_admission = engine.config.replace(selector="cachecraft", variant_admission_max_chunks=0)
    out = {name: {"runs": [], "fractions": []} for name in settings}
    for item, reference in zip(measured, references, strict=True):
        prompt = build_rag_prompt(tokenizer, item.system, item.chunks, item.question)
        for name, (selector, ratio) in settings.items():
            if name == "full_prefill":
                result, fraction = reference.result, 1.0
            else:
                engine.config = no_admission
                result, stats = engine.prefill(prompt.token_ids, prompt.chunks, selector=selector, ratio=ratio,
                                               save_holes=False)
                assert stats.chunks_missed == 0, stats.miss_reasons  # base variants of every chunk are stored
                fraction = chunk_fraction(result, prompt)
            run, _ = measure_run(engine, tokenizer, item, spec, prompt, result, reference)
            out[name]["runs"].append(run)
            out[name]["fractions"].append(fraction)
            bar.update(1)
    return out


def matched_recompute(engine, tokenizer, measured, references, spec: EvalSpec, targets, at_ratio, bar,
                      selector: str = "cacheblend") -> dict:
    """`selector` with admission off on the measured prompts (nothing saved), each at the ratio that computes
    its `targets` fraction: the fraction is linear in the ratio (up to a row per chunk), so from the
    fraction at ratio 0 (full layers only) and at `at_ratio` = (ratio, fractions) the ratio is interpolated.
    Exact chunks are no candidates, which a closed form from the prompt's lengths would miss."""
    engine.config = engine.config.replace(selector=selector, variant_admission_max_chunks=0)
    ratio_known, fractions_known = at_ratio
    out = {"runs": [], "fractions": [], "ratios": []}

    def fused(prompt, ratio):
        result, stats = engine.prefill(prompt.token_ids, prompt.chunks, selector=selector, ratio=ratio,
                                       save_holes=False)
        assert stats.chunks_missed == 0, stats.miss_reasons
        return result

    for item, reference, target, known in zip(measured, references, targets, fractions_known, strict=True):
        prompt = build_rag_prompt(tokenizer, item.system, item.chunks, item.question)
        floor = chunk_fraction(fused(prompt, 0.0), prompt)
        ratio = round(min(1.0, max(0.0, ratio_known * (target - floor) / (known - floor))), 4)
        result = fused(prompt, ratio)
        run, _ = measure_run(engine, tokenizer, item, spec, prompt, result, reference)
        out["runs"].append(run)
        out["fractions"].append(chunk_fraction(result, prompt))
        out["ratios"].append(ratio)
        bar.update(1)
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_q, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, entry in report["measured"]["settings"].items():
        ax_q.errorbar(100 * entry["recompute_fraction"], entry["f1"]["mean"], yerr=1.96 * entry["f1"]["se"],
                      marker="o", capsize=3, label=f"{name} (KL {entry['kl_mean']:.3f})")
    ax_q.set(xlabel="retrieved-chunk tokens recomputed, mean over layers (%)", ylabel="token F1",
             title=f"rounds >= {report['workload']['measure_from']}: {report['measured']['requests']} requests")
    ax_q.legend(fontsize=7)
    rounds = report["served"]["per_round"]
    xs = [int(r) for r in rounds]
    ax_s.plot(xs, [100 * rounds[r]["fraction_mean"] for r in rounds], marker="o", label="recomputed (%)")
    ax_s.plot(xs, [100 * rounds[r]["cfo_mean"] for r in rounds], marker="s", label="mean CFO of loaded chunks (%)")
    ax_s.plot(xs, [rounds[r]["variants_total"] for r in rounds], marker="^", label="fused variants stored")
    for selector, admission in admission_runs(report).items():
        blend = admission.get("served_per_round", {})
        for key, label in (("on", "admission on"), ("off", "admission off")):
            if key in blend:
                ax_s.plot(xs, [100 * blend[key][r]["fraction_mean"] for r in blend[key]], marker="x",
                          linestyle="--", label=f"{selector}, {label}: recomputed (%)")
    ax_s.set(xlabel="round", xticks=xs, title="served stream, per round (cachecraft unless named)")
    ax_s.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def admission_pair(model: Path, selector: str) -> tuple:
    """Two reference engines of `selector` at its default ratio: admission at cachecraft's threshold (alpha / 2,
    one chunk per request), and admission off."""
    on, _ = reference_engine(model, CacheFuseConfig(selector=selector, variant_admission_cfo=0.5))
    off, _ = reference_engine(model, CacheFuseConfig(selector=selector, variant_admission_max_chunks=0))
    return on, off


def admission_runs(report: dict) -> dict:
    """selector -> its admission run; a file from before `admission` holds cacheblend's alone."""
    if "admission" in report:
        return report["admission"]
    return {"cacheblend": report["cacheblend_admission"]} if "cacheblend_admission" in report else {}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=smollm2.DEFAULT_DIR)
    parser.add_argument("--items", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--measure-from", type=int, default=None, help="first measured round (default rounds // 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/cachecraft_variants.json"))
    parser.add_argument("--admission-selectors", default="cacheblend,qcfuse",
                        help="selectors whose admission on/off/matched runs are measured (comma-separated)")
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from --out's JSON, run nothing")
    args = parser.parse_args(argv)
    if args.replot:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return 0
    torch.set_num_threads(args.threads)
    measure_from = args.rounds // 2 if args.measure_from is None else args.measure_from
    started = time.perf_counter()
    served_engine, tokenizer = reference_engine(args.model, CacheFuseConfig(selector="cachecraft"))
    base_engine, _ = reference_engine(args.model, CacheFuseConfig(variant_admission_max_chunks=0))
    selectors = [name for name in args.admission_selectors.split(",") if name]
    if "cacheblend" not in selectors:  # its admission-off run prices cachecraft's matched recompute
        selectors.insert(0, "cacheblend")
    admission_engines = {name: admission_pair(args.model, name) for name in selectors}
    qa = make_items("test", args.items, seed=args.seed)
    stream = make_stream(qa, eval_items(qa, tokenizer), args.rounds, args.seed)
    for _, item in stream:  # the store starts with what offline precompute writes, nothing more
        prompt = build_rag_prompt(tokenizer, item.system, item.chunks, item.question)
        for engine in (served_engine, base_engine, *(e for pair in admission_engines.values() for e in pair)):
            store_base_variants(engine, prompt)
    spec = EvalSpec(selectors=("cacheblend", "cachecraft"), ratios=(0.0,), metric="f1", max_new_tokens=MAX_NEW_TOKENS)
    measured = [item for round_, item in stream if round_ >= measure_from]
    total = len(stream) + 3 * len(measured) + len(selectors) * (2 * len(stream) + len(measured)) + len(measured)
    with tqdm(total=total, unit="prefill", desc="cachecraft_variants") as bar:
        served = serve(served_engine, tokenizer, stream, spec, measure_from, bar)
        references = served["references"]
        others = baselines(base_engine, tokenizer, measured, references, spec, bar)
        admission = {}
        for name, (on_engine, off_engine) in admission_engines.items():
            blend = {"on": serve(on_engine, tokenizer, stream, spec, measure_from, bar, references),
                     "off": serve(off_engine, tokenizer, stream, spec, measure_from, bar, references)}
            at_default = (off_engine.config.recompute_ratio, blend["off"]["fractions"])
            blend["matched"] = matched_recompute(base_engine, tokenizer, measured, references, spec,
                                                 blend["on"]["fractions"], at_default, bar, name)
            admission[name] = (blend, on_engine, at_default)
        # cacheblend at cachecraft's recompute, request by request (labelled by its mean ratio)
        matched = matched_recompute(base_engine, tokenizer, measured, references, spec, served["fractions"],
                                    admission["cacheblend"][2], bar)
        ratio = round(statistics.fmean(matched["ratios"]), 4)
        others[setting_name("cacheblend", ratio)] = matched
    report = build_report(args, measured, served, others, ratio, served_engine)
    report["admission"] = {name: admission_report(blend, on_engine, report["measured"]["settings"])
                           for name, (blend, on_engine, _) in admission.items()}
    report["seconds"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(json.dumps(report["measured"]["settings"], indent=2))
    return 0


def build_report(args, measured, served, others, ratio, served_engine) -> dict:
    """The JSON: per setting F1, KL, top-1 and recompute fraction over the measured requests (paired
    statistics from cachefuse.eval.report.summarize), the served stream per round, the variants."""
    spec = EvalSpec(selectors=("cacheblend", "cachecraft"), ratios=(ratio,), metric="f1", max_new_tokens=MAX_NEW_TOKENS)
    runs = EvalRuns(measured, spec, {name: entry["runs"] for name, entry in others.items()})
    runs.runs[setting_name("cachecraft", ratio)] = served["runs"]  # the served run, labelled at the matched ratio
    summary = summarize(runs)
    fractions = {name: entry["fractions"] for name, entry in others.items()}
    fractions[setting_name("cachecraft", ratio)] = served["fractions"]
    settings = {}
    for name, item_runs in runs.runs.items():
        label = "cachecraft (served, admission on)" if name == setting_name("cachecraft", ratio) else name
        quality = fidelity(item_runs)
        settings[label] = {"f1": mean_se([r.score for r in item_runs]).to_dict(),
                           "recompute_fraction": statistics.fmean(fractions[name]),
                           "kl_mean": quality["kl_mean"], "kl_median": quality["kl_median"],
                           "top1_agree": quality["top1_agree"], "greedy_match": quality["greedy_match"],
                           "paired": {k: v for k, v in summary["settings"].get(name, {}).get("by_kind", {})
                                      .get("all", {}).items() if k.startswith("vs_")}}
    records, config = served_engine.metastore.all_records(), served_engine.config
    fused = [r for r in records if r.prefix]
    per_round, total = {}, 0
    for round_, row in served["per_round"].items():
        total += row["admitted"]
        per_round[round_] = {"fraction_mean": statistics.fmean(row["fraction"]), "admitted": row["admitted"],
                             "cfo_mean": statistics.fmean(row["cfo"]) if row["cfo"] else 0.0,
                             "variants_total": total}
    cfo = served["cfo"]
    numeric = [c for c in cfo if c != "admitted"]
    return {
        "benchmark": "cachecraft_variants", "model": args.model.name, "threads": args.threads,
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "workload": {"split": "test", "items": args.items, "rounds": args.rounds, "measure_from": served["measure_from"],
                     "requests": args.items * args.rounds, "seed": args.seed, "max_new_tokens": MAX_NEW_TOKENS},
        "served_config": {"selector": config.selector, "cachecraft_alpha": config.cachecraft_alpha,
                          "variant_admission_cfo": config.variant_admission_cfo,
                          "resolved_admission_cfo": config.admission_cfo,
                          "variant_admission_max_chunks": config.variant_admission_max_chunks,
                          "cachecraft_early_termination": config.cachecraft_early_termination},
        "cacheblend_matched_ratio": ratio,
        "measured": {"requests": len(measured), "settings": settings, "summary": summary},
        "served": {"per_round": per_round, "holes_saved": served["saved"]},
        "variants": {"base": served["base_variants"], "fused_created": len(fused), "fused_with_stats": sum(r.has_stats for r in fused),
                     "fused_used": sum(r.access_count > 0 for r in fused),
                     "per_chunk_max": max(Counter(r.chunk_key for r in records).values())},
        "chosen_cfo_measured": {
            "chunks": len(cfo), "admitted": cfo.count("admitted"),
            "zero": sum(c == 0.0 for c in numeric), "below_0_5": sum(0.0 < c < 0.5 for c in numeric),
            "at_or_above_0_5": sum(c >= 0.5 for c in numeric),
            "mean_loaded": statistics.fmean(numeric) if numeric else None,
            "histogram": dict(sorted(Counter(round(c, 1) for c in numeric).items()))},
    }


def admission_report(blend: dict, on_engine, settings: dict) -> dict:
    """The engine's selector at its default ratio served with admission on against admission off (same prompts,
    same store start) and against admission off at each request's matched recompute: per setting F1, KL, top-1
    and recompute fraction (also added to `settings`), paired differences (on - other), the measured rounds
    one by one, the served stream per round (recompute, admitted chunks and tokens), the variants created."""
    on, off, matched = blend["on"], blend["off"], blend["matched"]
    ratio, selector = on_engine.config.recompute_ratio, on_engine.config.selector
    names = {"on": f"{selector}@{ratio:g} (served, admission on)", "off": f"{selector}@{ratio:g} (admission off)",
             "matched": f"{selector}, admission off, each request at admission on's recompute"}
    entries = {"on": on, "off": off, "matched": matched}
    for key, entry in entries.items():
        quality = fidelity(entry["runs"])
        settings[names[key]] = {"f1": mean_se([r.score for r in entry["runs"]]).to_dict(),
                                "recompute_fraction": statistics.fmean(entry["fractions"]),
                                "kl_mean": quality["kl_mean"], "kl_median": quality["kl_median"],
                                "top1_agree": quality["top1_agree"], "greedy_match": quality["greedy_match"],
                                "paired": {}}

    def paired(other: dict) -> dict:
        return {"f1": paired_diff([r.score for r in on["runs"]], [r.score for r in other["runs"]]).to_dict(),
                "kl": paired_diff([r.kl for r in on["runs"]], [r.kl for r in other["runs"]]).to_dict(),
                "greedy_match": paired_diff([r.greedy_match for r in on["runs"]],
                                            [r.greedy_match for r in other["runs"]]).to_dict(),
                "recompute_fraction": paired_diff(on["fractions"], other["fractions"]).to_dict()}

    by_round = {}
    for i, round_ in enumerate(on["rounds"]):
        row = by_round.setdefault(round_, {key: {"f1": [], "kl": [], "fraction": []} for key in entries})
        for key, entry in entries.items():
            row[key]["f1"].append(entry["runs"][i].score)
            row[key]["kl"].append(entry["runs"][i].kl)
            row[key]["fraction"].append(entry["fractions"][i])
    measured_rounds = {round_: {key: {metric: statistics.fmean(values) for metric, values in row[key].items()}
                                for key in row} for round_, row in by_round.items()}
    records = on_engine.metastore.all_records()
    fused = [r for r in records if r.prefix]
    served = {}
    for key in ("on", "off"):
        served[key] = {round_: {"fraction_mean": statistics.fmean(row["fraction"]), "admitted": row["admitted"],
                                "admitted_tokens_mean": statistics.fmean(row["admitted_tokens"]),
                                "cfo_mean": statistics.fmean(row["cfo"]) if row["cfo"] else 0.0}
                       for round_, row in entries[key]["per_round"].items()}
    cfo = on["cfo"]
    numeric = [c for c in cfo if c != "admitted"]
    return {
        "selector": selector, "settings": names, "recompute_ratio": ratio,
        "matched_ratios": {"mean": statistics.fmean(matched["ratios"]), "min": min(matched["ratios"]),
                           "max": max(matched["ratios"])},
        "admission_cfo": on_engine.config.admission_cfo,
        "max_chunks": on_engine.config.variant_admission_max_chunks,
        "attention_stats": on_engine.config.gathers_attention_stats,
        "paired_on_minus_off": paired(off), "paired_on_minus_matched": paired(matched),
        "measured_rounds": measured_rounds, "served_per_round": served,
        "admitted_tokens_per_request_measured": statistics.fmean(on["admitted_tokens"]),
        "variants": {"fused_created": len(fused), "fused_used": sum(r.access_count > 0 for r in fused),
                     "fused_bytes": sum(r.size_bytes for r in fused), "holes_saved": on["saved"],
                     "per_chunk_max": max(Counter(r.chunk_key for r in records).values())},
        "chosen_cfo_measured": {
            "chunks": len(cfo), "admitted": cfo.count("admitted"), "zero": sum(c == 0.0 for c in numeric),
            "below_0_5": sum(0.0 < c < 0.5 for c in numeric), "at_or_above_0_5": sum(c >= 0.5 for c in numeric)},
    }


if __name__ == "__main__":
    raise SystemExit(main())

"""Why query-aware selectors keep the first token and lose the answer: per-position divergence on SmolLM2.

    make model && python benchmarks/query_aware_divergence.py             # ~12 min on 1 CPU thread (40 items)
    python benchmarks/query_aware_divergence.py --remedies --out /tmp/remedies.json   # ~18 min: the two remedies
    python benchmarks/query_aware_divergence.py --items 2 --out /tmp/div.json   # a smoke run

Issue 30 item 6: at 15% the query-aware selectors (fusionrag, qcfuse) keep the *first* answer token
closer to full prefill than cacheblend (lower first-token KL), yet lose more of the 8-token answer. This
measures, on the QA set's test split (reference engine, every chunk its base variant, 1 thread):

- per-position KL(full || fused) of answer tokens 1..8, every setting teacher-forced on the full
  prefill's own greedy continuation (cachefuse.eval.fidelity.teacher_forced_logits), so each position
  compares the same context; top-1 agreement per position; free greedy match and F1 as the harness;
- which rows each setting recomputes: recall of the evidence rows (where the answer is written,
  cachefuse.eval.qa_set.answer_evidence_rows, those among the candidates) and of the rows the full prefill attends to most
  (summed over heads and layers) from the last prompt token (what the first token reads) and from
  the answer tokens 2..8 (what the rest of the answer reads), each the top `ceil(r x candidates)`;
- ablations that separate the rows from the layers: `<selector>_rows+2full` recomputes exactly the
  rows the query-aware selector chose, after CacheBlend's two full layers (FixedSelector), and
  `cacheblend_rows+0full` CacheBlend's rows with no full layer.

With `--remedies` the settings are two candidate remedies instead, on the same items and reference:

- `fusionrag+first_token`: FusionRAG's score (the question rows' last-layer attention over the loaded
  caches, emulated here by transformers over full reuse's K/V, which is what the full-view probe
  computes), averaged over the question rows, plus the attention of one more query row, the first answer
  token the probe itself predicts (full reuse's greedy first token), fed after the prompt: the answer
  token weighs as much as the whole question; `fusionrag_emulated` is the score
  without that row (a check: it should choose fusionrag's own rows);
- `mix_qcfuse+hkvd`: half the budget from qcfuse (its selection at r/2), the rest from cacheblend's
  (at r/2, topped up from its selection at r), after CacheBlend's two full layers.

Writes `--out` (JSON): per setting the mean per-position KL, its standard error, top-1 agreement per
position, greedy match, F1 and the recall figures, and every item's numbers.
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
from cachefuse.eval import stats  # noqa: E402
from cachefuse.eval.fidelity import (  # noqa: E402
    greedy_continuation,
    logits_kl,
    matching_prefix,
    teacher_forced_logits,
)
from cachefuse.eval.harness import (  # noqa: E402
    decode_text,
    fresh_store,
    full_prefill,
    reference_engine,
    selector_at,
    store_base_variants,
)
from cachefuse.eval.metrics import best_score, qa_f1_score  # noqa: E402
from cachefuse.eval.qa_set import answer_evidence_rows, eval_items, make_items  # noqa: E402
from cachefuse.select.base import num_rows_for_ratio  # noqa: E402
from cachefuse.select.fixed import FixedSelector  # noqa: E402
from cachefuse.testing import smollm2  # noqa: E402

MAX_NEW_TOKENS = 8
SELECTORS = ("cacheblend", "epic", "fusionrag", "qcfuse")
QUERY_AWARE = ("fusionrag", "qcfuse")
CACHEBLEND_FULL_LAYERS = 2  # layers 0 and 1, as its default check layer 1 computes them


def candidate_rows(prompt, num_candidates: int) -> torch.Tensor:
    """Rows of the declared chunks the engine counts as candidates (`num_candidates` of them): never the
    system chunk, nor the first retrieved chunk where it sits at its exact place, right after the system
    prompt it was precomputed after (reused as is; docs/selectors.md, ratio accounting). Before exact places
    existed that chunk was a candidate; the rule is read from the count so that older trees are measured
    alike."""
    system_end = prompt.chunks[0][1] if prompt.chunks[0][0] == 0 else 0
    retrieved = [(start, end) for start, end in prompt.chunks if start != 0]
    if sum(end - start for start, end in retrieved) != num_candidates:
        retrieved = [(start, end) for start, end in retrieved if start != system_end]
    rows = torch.cat([torch.arange(start, end) for start, end in retrieved])
    assert rows.numel() == num_candidates, (rows.numel(), num_candidates)
    return rows


def selected_rows(result, candidates: torch.Tensor) -> set[int]:
    """Candidate rows the pass recomputed in its last layer (every selector's final selection)."""
    last = result.rows_per_layer[-1]
    return set(candidates.tolist()) if last is None else set(last.tolist()) & set(candidates.tolist())


@torch.inference_mode()
def decode_attention(adapter, full, last_token_id: int, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), num_prompt_tokens]: the full prefill's attention to each prompt row from the last
    prompt token (row 0, recomputed over the other rows) and from answer tokens 1..n-1 fed after it,
    summed over heads and layers (eager attention)."""
    from transformers import DynamicCache

    model = adapter.model
    cache = DynamicCache(ddp_cache_data=[
        (k[:-1].transpose(0, 1)[None].contiguous(), v[:-1].transpose(0, 1)[None].contiguous())
        for k, v in zip(full.k, full.v, strict=True)])
    num_prompt = full.k[0].shape[0]
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        ids = [int(last_token_id)] + tokens[:-1]
        out = model(torch.tensor([ids]), position_ids=torch.arange(num_prompt - 1, num_prompt - 1 + len(ids))[None],
                    past_key_values=cache, use_cache=True, output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    return sum(a[0, :, :, :num_prompt].float().sum(dim=0) for a in out.attentions)


def top_set(score: torch.Tensor, candidates: torch.Tensor, count: int) -> set[int]:
    order = torch.argsort(score[candidates], descending=True, stable=True)[:count]
    return set(candidates[order].tolist())


def recall(chosen: set[int], wanted: set[int]) -> float | None:
    return len(chosen & wanted) / len(wanted) if wanted else None


@torch.inference_mode()
def probe_scores_with_first_token(adapter, reuse, question_start: int, token_ids: list[int]) -> tuple:
    """[num_prompt_tokens] x 2: the question rows' last-layer attention to each row over full reuse's K/V
    (FusionRAG's full-view probe score: summed over the rows and heads, eager attention, full causal
    denominator), and that score averaged over the question rows plus the attention from the probe's own
    first answer token fed after them (summed over heads)."""
    from transformers import DynamicCache

    model = adapter.model
    cache = DynamicCache(ddp_cache_data=[
        (k[:question_start].transpose(0, 1)[None].contiguous(), v[:question_start].transpose(0, 1)[None].contiguous())
        for k, v in zip(reuse.k, reuse.v, strict=True)])
    num_prompt = len(token_ids)
    ids = token_ids[question_start:] + [int(reuse.logits.argmax())]
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(torch.tensor([ids]), position_ids=torch.arange(question_start, question_start + len(ids))[None],
                    past_key_values=cache, use_cache=True, output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    last = out.attentions[-1][0, :, :, :num_prompt].float().sum(dim=0)  # [query rows, keys]
    question = last[:-1].sum(dim=0)
    return question, question / (len(ids) - 1) + last[-1]  # the answer token weighs as the question rows together


def run_item(engine, tokenizer, qa_item, item, ratio: float, remedies: bool = False) -> dict:
    from cachefuse.rag_prompt import build_rag_prompt

    prompt = build_rag_prompt(tokenizer, item.system, item.chunks, item.question)
    _, evidence = answer_evidence_rows(qa_item, item, tokenizer)
    fresh_store(engine)
    store_base_variants(engine, prompt)
    adapter = engine.adapter
    reuse, _ = engine.prefill(prompt.token_ids, prompt.chunks, selector="full_reuse", ratio=0.0, save_holes=False)
    candidates = candidate_rows(prompt, reuse.num_candidates)
    count = num_rows_for_ratio(ratio, candidates.numel())

    full = full_prefill(engine, prompt)
    reference = greedy_continuation(adapter, full, MAX_NEW_TOKENS)
    full_forced = teacher_forced_logits(adapter, full, reference)
    attention = decode_attention(adapter, full, prompt.token_ids[-1], reference)
    wanted = {"evidence": set(evidence) & set(candidates.tolist()), "first_token_attention": top_set(attention[0], candidates, count),
              "later_tokens_attention": top_set(attention[1:].sum(dim=0), candidates, count)}

    out = {"num_candidates": int(candidates.numel()), "count": count,
           "first_vs_later_attention_overlap": len(wanted["first_token_attention"]
                                                    & wanted["later_tokens_attention"]) / count,
           "settings": {}}

    def measure(name, result):
        forced = teacher_forced_logits(adapter, result, reference)
        tokens = greedy_continuation(adapter, result, MAX_NEW_TOKENS)
        chosen = selected_rows(result, candidates)
        out["settings"][name] = {
            "kl": [round(max(0.0, logits_kl(full_forced[i], forced[i])), 5) for i in range(len(reference))],
            "top1": [bool(forced[i].argmax() == reference[i]) for i in range(len(reference))],
            "greedy_match": matching_prefix(tokens, reference) / MAX_NEW_TOKENS,
            "f1": best_score(qa_f1_score, decode_text(tokenizer, tokens), item.answers),
            "recall": {k: recall(chosen, v) for k, v in wanted.items()},
            "num_selected": len(chosen)}
        return chosen

    measure("full_prefill", full)
    measure("full_reuse", reuse)
    if remedies:
        return run_remedies(engine, prompt, candidates, count, ratio, reuse, measure, out)
    chosen = {}
    for name in SELECTORS:
        result, stats = engine.prefill(prompt.token_ids, prompt.chunks, selector=selector_at(engine, name, ratio),
                                       ratio=ratio, save_holes=False)
        assert not stats.chunks_missed, stats.miss_reasons
        chosen[name] = measure(name, result)
    ablations = {f"{name}_rows+2full": FixedSelector(sorted(chosen[name]), CACHEBLEND_FULL_LAYERS)
                 for name in QUERY_AWARE}
    ablations["cacheblend_rows+0full"] = FixedSelector(sorted(chosen["cacheblend"]), 0)
    for name, selector in ablations.items():
        result, _ = engine.prefill(prompt.token_ids, prompt.chunks, selector=selector, ratio=ratio, save_holes=False)
        measure(name, result)
    return out


def run_remedies(engine, prompt, candidates, count, ratio, reuse, measure, out) -> dict:
    def fused(selector, at=ratio):
        result, stats = engine.prefill(prompt.token_ids, prompt.chunks, selector=selector, ratio=at, save_holes=False)
        assert not stats.chunks_missed, stats.miss_reasons
        return result

    question_start = max(end for _, end in prompt.chunks)
    plain, with_first = probe_scores_with_first_token(engine.adapter, reuse, question_start, list(prompt.token_ids))
    own = selected_rows(fused(selector_at(engine, "fusionrag", ratio)), candidates)
    emulated = top_set(plain, candidates, count)
    out["fusionrag_emulation_overlap"] = len(own & emulated) / count
    measure("fusionrag_emulated", fused(FixedSelector(sorted(emulated), 0)))
    measure("fusionrag+first_token", fused(FixedSelector(sorted(top_set(with_first, candidates, count)), 0)))
    half = num_rows_for_ratio(ratio / 2, candidates.numel())
    rows = selected_rows(fused(selector_at(engine, "qcfuse", ratio / 2)), candidates)
    rows |= selected_rows(fused(selector_at(engine, "cacheblend", ratio / 2)), candidates)
    for row in sorted(selected_rows(fused(selector_at(engine, "cacheblend", ratio)), candidates) - rows):
        if len(rows) >= count:
            break
        rows.add(row)
    out["mix_rows_from_qcfuse"] = half
    measure("mix_qcfuse+hkvd", fused(FixedSelector(sorted(rows), CACHEBLEND_FULL_LAYERS)))
    return out


def mean_se(values: list[float]) -> tuple[float, float]:
    stat = stats.mean_se(values)
    return stat.mean, stat.se


PAIRED_METRICS = {
    "kl_first": lambda run: run["kl"][0],
    "kl_later_mean": lambda run: sum(run["kl"][1:]) / (len(run["kl"]) - 1),
    "top1_first": lambda run: float(run["top1"][0]),
    "greedy_match": lambda run: run["greedy_match"],
    "f1": lambda run: run["f1"],
}
"""Per-item figures compared between settings, paired over items."""


def paired(items: list[dict], name: str, base: str) -> dict:
    """`name` - `base` per PAIRED_METRICS: mean difference, 95% CI and p (cachefuse.eval.stats)."""
    out = {}
    for metric, value in PAIRED_METRICS.items():
        diff = stats.paired_bootstrap([value(i["settings"][name]) for i in items],
                                      [value(i["settings"][base]) for i in items])
        out[metric] = {"diff": round(diff.diff, 4), "ci95": [round(diff.ci_low, 4), round(diff.ci_high, 4)],
                       "p": round(diff.p_value, 3)}
    return out


def summarize(items: list[dict]) -> dict:
    names = items[0]["settings"].keys()
    out = {}
    for name in names:
        runs = [item["settings"][name] for item in items]
        kl = [mean_se([r["kl"][i] for r in runs]) for i in range(MAX_NEW_TOKENS)]
        out[name] = {
            "kl_by_position": [round(m, 4) for m, _ in kl], "kl_se_by_position": [round(s, 4) for _, s in kl],
            "kl_first": round(kl[0][0], 4),
            "kl_later_mean": round(sum(m for m, _ in kl[1:]) / (MAX_NEW_TOKENS - 1), 4),
            "top1_by_position": [round(sum(r["top1"][i] for r in runs) / len(runs), 3) for i in range(MAX_NEW_TOKENS)],
            "greedy_match": round(mean_se([r["greedy_match"] for r in runs])[0], 3),
            "f1": round(mean_se([r["f1"] for r in runs])[0], 3),
            "recall": {k: round(mean_se(vals)[0], 3) if (vals := [r["recall"][k] for r in runs
                                                                   if r["recall"][k] is not None]) else None
                       for k in runs[0]["recall"]}}
    for name, entry in out.items():
        for base in ("cacheblend", "qcfuse"):
            if base in out and name not in ("full_prefill", "full_reuse", "cacheblend", base):
                entry[f"vs_{base}"] = paired(items, name, base)
    full_f1, reuse_f1 = out["full_prefill"]["f1"], out["full_reuse"]["f1"]
    for entry in out.values():
        gap = full_f1 - reuse_f1
        entry["normalized_f1_by_hand"] = round((entry["f1"] - reuse_f1) / gap, 3) if gap > 0 else None
    return out


def write_report(report: dict, path: Path) -> None:
    """JSON with the summary indented and one line per item (small enough to commit)."""
    head = json.dumps({**report, "per_item": "@per_item@"}, indent=1)
    lines = ",\n".join(json.dumps(item, separators=(",", ":")) for item in report["per_item"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head.replace('"@per_item@"', "[\n" + lines + "\n]") + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=smollm2.DEFAULT_DIR)
    parser.add_argument("--items", type=int, default=40)
    parser.add_argument("--first-item", type=int, default=0)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--remedies", action="store_true", help="measure the two remedies (module doc) instead")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/smollm2/query_aware_divergence.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine, tokenizer = reference_engine(args.model, CacheFuseConfig())
    started = time.perf_counter()
    qa_items = make_items("test", args.first_item + args.items)[args.first_item:]
    items = eval_items(qa_items, tokenizer)
    per_item = []
    for index, (qa_item, item) in enumerate(zip(qa_items, items, strict=True)):
        per_item.append(run_item(engine, tokenizer, qa_item, item, args.ratio, args.remedies))
        print(f"item {index + 1}/{len(items)} {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)
    report = {"benchmark": "query_aware_divergence", "model": str(args.model), "threads": args.threads,
              "machine": {"platform": platform.platform(), "torch": torch.__version__},
              "split": "test", "first_item": args.first_item, "items": args.items, "ratio": args.ratio,
              "max_new_tokens": MAX_NEW_TOKENS,
              "first_vs_later_attention_overlap": round(mean_se(
                  [i["first_vs_later_attention_overlap"] for i in per_item])[0], 3),
              "summary": summarize(per_item), **({"fusionrag_emulation_overlap": round(mean_se(
                  [i["fusionrag_emulation_overlap"] for i in per_item])[0], 3)} if args.remedies else {}), "per_item": per_item,
              "seconds": round(time.perf_counter() - started, 1)}
    write_report(report, args.out)
    print(json.dumps({k: report[k] for k in ("first_vs_later_attention_overlap", "summary")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

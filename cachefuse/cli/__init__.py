"""The `cachefuse` command line: one subcommand per offline job, one module per subcommand.

    cachefuse precompute   store chunks' base variants through vLLM         cli/precompute.py
    cachefuse profile      measure the loading controller's figures          cli/profile_figures.py
    cachefuse inspect      list a store's variants, stale rows and orphans   cli/inspect_store.py
    cachefuse tune-alpha   fit Cache-Craft's alpha on a validation set       cli/tune_alpha.py
    cachefuse eval         quality per selector and ratio                    cli/eval.py
    cachefuse fetch-model  the SmolLM2-135M-Instruct checkpoint, converted   cli/fetch_model.py
    cachefuse profile-layers  QCFuse's critical layers for a model        cli/profile_layers.py

Each module declares `NAME`, `HELP` and `DESCRIPTION`, `add_arguments(parser)`, which registers its
arguments, and `run(args, parser)`, which does the work (vLLM's `entrypoints/cli` is built the same way);
arguments shared by several live in cli/args.py. Two modules are not named after their command, `profile_figures`
and `inspect_store`, so that no module of the package shadows the standard library's `profile` and
`inspect`. Bad arguments and input files end in
`parser.error` (exit status 2) before any engine starts. Importing the package loads the standard library
and cachefuse.{config, errors, jsonl} only: vllm loads when a subcommand starts an engine.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cachefuse.cli import eval as eval_command
from cachefuse.cli import fetch_model, inspect_store, precompute, profile_figures, profile_layers, tune_alpha

SUBCOMMANDS = (precompute, profile_figures, inspect_store, tune_alpha, eval_command, fetch_model, profile_layers)


def build_parser() -> argparse.ArgumentParser:
    """The `cachefuse` parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="cachefuse", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in SUBCOMMANDS:
        sub = subparsers.add_parser(command.NAME, help=command.HELP, description=command.DESCRIPTION)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run, parser=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `cachefuse` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.run(args, args.parser)


if __name__ == "__main__":
    sys.exit(main())

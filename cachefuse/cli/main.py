"""The `cachefuse` parser with every subcommand (cli/__init__.py lists them) and the console script's `main`."""


from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cachefuse.cli import eval as eval_command
from cachefuse.cli import fetch_model, inspect_store, precompute, profile_figures, profile_layers, tune_alpha

SUBCOMMANDS = (precompute, profile_figures, inspect_store, tune_alpha, eval_command, fetch_model, profile_layers)


def build_parser() -> argparse.ArgumentParser:
    """The `cachefuse` parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="cachefuse", description="The `cachefuse` command line: one subcommand per offline job, one module per subcommand.")
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

"""`cachefuse inspect`: what a store holds, variant by variant (the report is cachefuse.store_report's).

    cachefuse inspect --store DIR|redis://host:port/db [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from cachefuse.errors import ConfigError, StoreError

NAME = "inspect"
HELP = "list a store's chunks, variants, CCI, f_r, sizes, tiers and stale entries"
DESCRIPTION = (
    "Reads a store without changing it: every variant's metadata, whether its K/V entry is "
    "still there (stale: a metadata row whose data is gone), and K/V entries without metadata "
    "(orphans). Exit status 1 when the store cannot be read.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", required=True, help="a store directory (store_dir) or a redis:// / rediss:// URL")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from cachefuse.store_report import format_table, inspect_store

    try:
        report = inspect_store(args.store)
    except ConfigError as exc:
        parser.error(str(exc))
    except StoreError as exc:
        from cachefuse.redis_client import redact_url

        print(f"cachefuse inspect: {redact_url(args.store)}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_table(report))
    return 0

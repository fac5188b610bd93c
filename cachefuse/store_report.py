"""What a store holds, variant by variant, and what is out of step (`cachefuse inspect --store URL`).

Imports the standard library and cachefuse.{config, metadata, store.disk}; Redis only for a redis:// URL.
A store URL is a directory (the disk tier, with `meta.sqlite` next to it) or `redis://` / `rediss://`.

Reported per variant: chunk key, variant id, prefix, CCI, f_r, access count, size, tier, whether it
has attention statistics, the ratio its prefix was fused under, whether the offline neighbour step stored
it (`neighbour_fused`, JSON only), and `stale` (a metadata row whose
K/V entry is gone). Orphans are K/V entries without a metadata row: under a plain chunk key they are
served as base variants without statistics (docs/variants.md); under a variant key they are leftovers
that nothing will load (a crash between the K/V write and the metadata row).
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachefuse.config import rank_dir_name
from cachefuse.errors import ConfigError, StoreError
from cachefuse.metadata.base import MetaStore, VariantRecord
from cachefuse.metadata.sqlite import META_FILE, SqliteMetaStore

logger = logging.getLogger(__name__)


@dataclass
class StoreReport:
    url: str
    variants: list[dict[str, Any]] = field(default_factory=list)
    orphans: list[dict[str, Any]] = field(default_factory=list)

    @property
    def summary(self) -> dict[str, Any]:
        by_tier: dict[str, int] = {}
        for v in self.variants:
            by_tier[v["tier"]] = by_tier.get(v["tier"], 0) + v["size_bytes"]
        return {"chunks": len({v["chunk_key"] for v in self.variants}), "variants": len(self.variants),
                "stale": sum(v["stale"] for v in self.variants), "orphans": len(self.orphans),
                "bytes_by_tier": by_tier}

    def to_dict(self) -> dict[str, Any]:
        return {"store": self.url, "summary": self.summary, "variants": self.variants, "orphans": self.orphans}


def _row(record: VariantRecord, stored: set[str]) -> dict[str, Any]:
    return {"chunk_key": record.chunk_key, "variant_id": record.variant_id, "store_key": record.store_key,
            "prefix": list(record.prefix), "cci": record.cci, "f_r": record.f_r,
            "access_count": record.access_count, "size_bytes": record.size_bytes, "tier": record.tier,
            "has_stats": record.has_stats, "recompute_ratio": record.recompute_ratio,
            "neighbour_fused": record.neighbour_fused, "num_tokens": record.num_tokens, "stale": record.store_key not in stored}


def report_from(url: str, metastore: MetaStore, list_kv_keys: Callable[[], set[str]]) -> StoreReport:
    """The report for one metadata store and the K/V keys its tiers hold, listed after the rows are read:
    a save writes its K/V before its row, so a row read first finds its entry listed (listed first, a
    save landing in between showed a healthy variant as stale)."""
    records = metastore.all_records()
    kv_keys = list_kv_keys()
    report = StoreReport(url, [_row(r, kv_keys) for r in records])
    known = {r.store_key for r in records}
    for key in sorted(kv_keys - known):
        kind = "variant_leftover" if "-" in key else "base_without_metadata"
        report.orphans.append({"store_key": key, "kind": kind})
    return report


def inspect_store(url: str, *, timeout_s: float = 2.0) -> StoreReport:
    """Reads a store (directory or redis:// URL) without changing it.

    Raises:
        ConfigError: the directory holds no cachefuse store, or the URL is not understood.
        StoreError: Redis did not answer.
    """
    if url.startswith(("redis://", "rediss://")):
        return _inspect_redis(url, timeout_s)
    return _inspect_directory(url)


def _inspect_redis(url: str, timeout_s: float) -> StoreReport:
    """A Redis namespace's rows and entries, read-only (the URL's password never reaches the report)."""
    from cachefuse.redis_client import redact_url, require_redis_package

    require_redis_package("--store redis://...")
    from cachefuse.metadata.redis import RedisMetaStore
    from cachefuse.store.redis import list_redis_keys

    metastore = RedisMetaStore(url, max_variants=1 << 62, timeout_s=timeout_s, read_only=True)
    try:
        return report_from(redact_url(url), metastore, lambda: list_redis_keys(url, timeout_s=timeout_s))
    finally:
        metastore.close()


def _inspect_directory(url: str) -> StoreReport:
    """A store directory's rows (read-only SQLite, or a copy when a hot journal needs rolling back), then
    its entries (rank 0's under tensor parallelism)."""
    from cachefuse.store.disk import list_keys

    root = os.path.expanduser(url)
    meta_path = os.path.join(root, META_FILE)
    if not os.path.isdir(root):
        raise ConfigError(f"--store {url!r}: no such directory (expected a store_dir or a redis:// URL)")
    # Under tensor parallelism each rank's K/V have a directory (CacheFuseConfig.kv_store_path); the
    # metadata rows are rank 0's keys, so rank 0's entries are the ones to report.
    def kv_keys() -> set[str]:
        return set(list_keys(root)).union(*(list_keys(rank0) for rank0 in Path(root).glob(rank_dir_name("*", 0))))

    if not os.path.exists(meta_path):  # no rows to read first: the one listing serves both
        listed = kv_keys()
        if not listed:
            raise ConfigError(f"--store {url!r}: no cachefuse store there (no {META_FILE}, no entries); pass the "
                              "engine's store_dir")
        return report_from(url, _EmptyMeta(), lambda: listed)
    uri = f"file:{meta_path}?mode=ro"  # read-only: inspecting never creates or changes a store
    for _ in range(3):  # an engine recovering the store while inspect copies it: read the store again
        try:
            metastore = SqliteMetaStore(uri, max_variants=1 << 62, uri=True)
        except StoreError as exc:
            if not _needs_rollback(exc):
                raise
            report = _report_from_recovered_copy(url, meta_path, kv_keys)
            if report is not None:
                return report
            continue
        try:
            return report_from(url, metastore, kv_keys)
        finally:
            metastore.close()
    raise StoreError(f"{meta_path}: its hot journal changed under every attempt to read a copy; retry")


def _needs_rollback(exc: StoreError) -> bool:
    """SQLite refused a read-only open because of a hot journal: a writer died inside a transaction, and the
    next read-write open rolls its half-written pages back."""
    cause = exc.__cause__
    return isinstance(cause, sqlite3.Error) and getattr(cause, "sqlite_errorname", "") == "SQLITE_READONLY_ROLLBACK"


def _report_from_recovered_copy(url: str, meta_path: str, kv_keys: Callable[[], set[str]]) -> StoreReport | None:
    """Reads a store whose metadata has a hot journal: the journal and then the file are copied and the copy
    rolled back (what the next engine to open the store does), so inspecting still changes nothing. The rows
    are the last committed ones. None when the journal changed while the file was copied (an engine
    recovered the store meanwhile: the file copied may be recovered or not, and the old journal no longer
    matches it); the caller reads the store again."""
    logger.warning("cachefuse inspect: %s has a hot journal (a writer died mid-transaction); reading a "
                   "rolled-back copy, the store itself is left for the next engine to recover", meta_path)
    journal = meta_path + "-journal"
    with tempfile.TemporaryDirectory(prefix="cachefuse-inspect-") as tmp:
        copy = os.path.join(tmp, META_FILE)
        try:
            with open(journal, "rb") as f:
                before = f.read()
        except FileNotFoundError:
            return None
        Path(copy + "-journal").write_bytes(before)
        shutil.copyfile(meta_path, copy)
        try:
            with open(journal, "rb") as f:
                unchanged = f.read() == before
        except FileNotFoundError:
            unchanged = False
        if not unchanged:
            return None
        metastore = SqliteMetaStore(copy, max_variants=1 << 62)
        try:
            return report_from(url, metastore, kv_keys)
        finally:
            metastore.close()


class _EmptyMeta:
    """A store written before the metadata store existed: no rows."""

    def all_records(self) -> list[VariantRecord]:
        return []


def format_table(report: StoreReport, width: int = 12) -> str:
    """The report as a fixed-width table, then the orphans and the summary."""
    head = f"{'chunk':<{width}} {'variant':<16} {'prefix':>6} {'CCI':>6} {'f_r':>10} {'uses':>5} " \
           f"{'bytes':>10} {'tier':<6} {'stats':<5} {'ratio':>5} stale"
    lines = [f"store: {report.url}", head]
    for v in report.variants:
        ratio = "-" if v["recompute_ratio"] is None else f"{v['recompute_ratio']:.2f}"
        lines.append(f"{v['chunk_key'][:width]:<{width}} {v['variant_id']:<16} {len(v['prefix']):>6} "
                     f"{v['cci']:>6.3f} {v['f_r']:>10.3g} {v['access_count']:>5} {v['size_bytes']:>10} "
                     f"{v['tier']:<6} {'yes' if v['has_stats'] else 'no':<5} {ratio:>5} "
                     f"{'STALE' if v['stale'] else ''}")
    for orphan in report.orphans:
        lines.append(f"orphan K/V entry {orphan['store_key']} ({orphan['kind']})")
    s = report.summary
    tiers = ", ".join(f"{tier} {size} B" for tier, size in sorted(s["bytes_by_tier"].items())) or "-"
    lines.append(f"{s['chunks']} chunks, {s['variants']} variants ({tiers}); {s['stale']} stale, "
                 f"{s['orphans']} orphan K/V entries")
    return "\n".join(lines)

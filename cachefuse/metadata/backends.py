"""Opens the configured metadata store: Redis when a URL is set, else SQLite beside the disk tier (or in
memory without one). Imports a backend only when asked for it (Redis only when configured); no torch."""

from __future__ import annotations

import os
from typing import Any

from cachefuse.errors import StoreError
from cachefuse.metadata.base import MetaStore


def open_metastore(store_dir: str | None, *, max_variants: int, policy: str = "f_r",
                   redis_url: str | None = None, redis_timeout_s: float = 0.5) -> MetaStore:
    """The configured metadata store: Redis when `redis_url` is set, else SQLite in `store_dir/meta.sqlite`
    (one file next to the disk tier), or in memory when there is no disk tier (`store_dir` None)."""
    if redis_url is not None:
        from cachefuse.metadata.redis import RedisMetaStore

        return RedisMetaStore(redis_url, max_variants=max_variants, policy=policy, timeout_s=redis_timeout_s)
    from cachefuse.metadata.sqlite import META_FILE, SqliteMetaStore

    if store_dir is None:
        return SqliteMetaStore(":memory:", max_variants=max_variants, policy=policy)
    try:
        os.makedirs(store_dir, exist_ok=True)
    except OSError as exc:  # a file in its place, no permission: a store failure the callers handle
        raise StoreError(f"store_dir {store_dir!r} cannot be used as a directory: {exc!r}") from exc
    return SqliteMetaStore(os.path.join(store_dir, META_FILE), max_variants=max_variants, policy=policy)


def open_config_metastore(config: Any) -> MetaStore:
    """`open_metastore` for a CacheFuseConfig: SQLite next to the disk tier, in memory without one, or Redis."""
    store_dir = str(config.store_path) if config.disk_capacity_bytes else None
    return open_metastore(store_dir, max_variants=config.max_variants, policy=config.eviction_policy,
                          redis_url=config.redis_connection_url, redis_timeout_s=config.redis_timeout_s)

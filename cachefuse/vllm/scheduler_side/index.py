"""The scheduler's variant index at start-up: loaded once, then kept current on a background thread.

Imports cachefuse.metadata and cachefuse.store.disk (for its listing of keys; importing it loads torch),
no vllm. The index
(cachefuse.metadata.index) is also kept current by the variants the worker reports saving and evicting
(hooks.py); the thread reloads it when the store's generation changes (other engines sharing it).
"""

from __future__ import annotations

import logging

from cachefuse.config import CacheFuseConfig
from cachefuse.metadata.backends import open_config_metastore
from cachefuse.metadata.index import VariantIndex
from cachefuse.metadata.refresher import IndexRefresher
from cachefuse.store.disk import DiskStore, list_keys

logger = logging.getLogger(__name__)


def start_index(index: VariantIndex, config: CacheFuseConfig, tp_size: int) -> IndexRefresher | None:
    """Loads the variant index once, then keeps it current on a background thread (other engines'
    saves reach it through the shared store). Never blocks planning: a failing store leaves the
    last snapshot and is retried every `index_refresh_interval_s`.

    Returns:
        The running refresher (stopped by `SchedulerSide.close`), or None when the metadata lives in the
        worker's memory only: the worker's reports are then the index.
    """
    if config.redis_url is None and not config.disk_capacity_bytes:
        return None
    # Rank 0's K/V entries on the local disk tier (those without metadata rows are base variants), listed
    # with every reload. A closure over plain values: the thread must not keep the scheduler alive.
    root = config.kv_store_path(tp_size, 0)
    plain_keys = (lambda: list_keys(root)) if config.disk_capacity_bytes else None
    refresher = IndexRefresher(index, lambda: open_config_metastore(config),
                               config.index_refresh_interval_s, plain_keys=plain_keys, plain_tier=DiskStore.name)
    try:
        store = open_config_metastore(config)
        try:
            refresher.refresh_once(store)  # the first load: records and the disk listing
        finally:
            store.close()
    except Exception as exc:  # noqa: BLE001 - start serving; the refresher retries
        logger.warning("cachefuse scheduler: variant metadata unavailable at start-up (%s: %s); "
                       "chunks are misses until it answers", type(exc).__name__, exc)
        if plain_keys is not None:
            index.add_plain_keys(plain_keys(), tier=DiskStore.name)
    return refresher.start()

"""The question probe's partial reads of stored chunks, before the blend pass selects its rows.

Imports torch, `cachefuse.store.base` and `cachefuse.loading.{loader, entries}` (miss reporting, the
blend's load budget); never vllm. A query-aware selector (qcfuse, fusionrag) scores rows with a probe
over each chunk's metadata, anchor rows and score-layer keys (cachefuse.fusion.probe); reading only those
instead of whole entries is what keeps the probe's load small when the pass itself then fetches layer
by layer (cachefuse.loading.loader).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import Tensor

from cachefuse.loading.entries import EntryReader
from cachefuse.loading.loader import read_or_unavailable
from cachefuse.store.base import KVStore

T = TypeVar("T")


class StoreProbeReads:
    """The question probe's reads, straight from the store, before selection (a ProbeSource,
    cachefuse.fusion.probe): each chunk's metadata (where its anchors are stored), its view rows of the layers
    the probe runs, and every row's K at the score layers; the rest of each entry is fetched layer by
    layer for the blend pass that follows. A miss raises LayerUnavailable, as a fetch does.

    Args:
        store: a store with `get_rows` and `get_meta` (every tier here; `supports_probe_reads`).
        keys: segment index -> chunk key.
        num_layers: the model's layers (the length of `layer_keys`).
        reader: the blend's EntryReader, whose budget (config `load_timeout_s`) these reads are charged
            to: none starts once it is spent (LayerUnavailable "load_timeout"); None: no bound.
    """

    def __init__(self, store: KVStore, keys: dict[int, str], num_layers: int,
                 reader: EntryReader | None = None) -> None:
        self.store, self.keys_by_index, self.num_layers = store, dict(keys), num_layers
        self.reader = reader
        self.bytes_read = 0

    def indices(self) -> list[int]:
        return sorted(self.keys_by_index)

    def meta(self, index: int) -> dict[str, str]:
        key = self.keys_by_index[index]
        return self._call(key, 0, lambda: read_or_unavailable(self.store, key, 0, lambda: self.store.get_meta(key)))

    def rows(self, index: int, layer: int, offsets: Tensor | None) -> tuple[Tensor, Tensor]:
        return self._read(index, layer, offsets, values=True)

    def keys(self, index: int, layer: int) -> Tensor:
        return self._read(index, layer, None, values=False)[0]

    def layer_keys(self, index: int) -> _LayerKeys:
        return _LayerKeys(self, index)

    def _call(self, key: str, layer: int, read: Callable[[], T]) -> T:
        return read() if self.reader is None else self.reader.budgeted_call(key, layer, read)

    def _read(self, index: int, layer: int, offsets: Tensor | None, values: bool):
        key = self.keys_by_index[index]
        kv = self._call(key, layer, lambda: read_or_unavailable(
            self.store, key, layer, lambda: self.store.get_rows(key, layer, offsets, values)))
        self.bytes_read += sum(t.nbytes for t in kv if t is not None)
        return kv


class _LayerKeys:
    """Every layer's K of one chunk, each read from the store when asked (QCFuse's key-norm anchors of
    a chunk that has none stored read them all)."""

    def __init__(self, reads: StoreProbeReads, index: int) -> None:
        self.reads, self.index = reads, index

    def __len__(self) -> int:
        return self.reads.num_layers

    def __getitem__(self, layer: int) -> Tensor:
        if not 0 <= layer < len(self):
            raise IndexError(layer)
        return self.reads.keys(self.index, layer)


def supports_probe_reads(store: KVStore) -> bool:
    """Whether the question probe can read `store` partially (StoreProbeReads)."""
    return hasattr(store, "get_rows") and hasattr(store, "get_meta")

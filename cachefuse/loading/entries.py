"""Reading a prompt's declared chunks from the store for one blend pass: whole entries before the pass,
or layer by layer during it, with why each miss missed and the time and bytes each tier served.

Imports `cachefuse.{call_deadline, chunks, errors, loading.loader, store.base}`; never torch's kernels, the
fusor or vllm (FusionEngine drives it). Under tensor parallelism the ranks agree on the hits before the pass
(`keep_agreed_hits`, after the pass's sum of hit flags over the ranks): a chunk one rank missed is a hole on
every rank, so no rank recomputes rows the others do not and the model's collectives stay in step (a
failure on any rank is every rank's through the PassBatch's agreement, cachefuse.fusion.batch).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from cachefuse import call_deadline
from cachefuse.call_deadline import CallDeadline
from cachefuse.chunks import Segment
from cachefuse.loading.loader import FetchLayer, LayerKV, LayerUnavailable
from cachefuse.store.base import ChunkKV, KVStore

logger = logging.getLogger(__name__)
T = TypeVar("T")

MISS_LOAD_TIMEOUT = "load_timeout"
"""A chunk the blend did not read because its `load_timeout_s` was spent (computed in full instead)."""


@dataclass
class LoadBudget:
    """The seconds one blend may spend in store calls (config `load_timeout_s`), shared by every reader of
    the blend: the serial reads, the loader thread's layer fetches, the question probe's reads, the
    metadata calls of its variants. Only the calls' own time is charged: a pipelined pass computes beside
    its reads, and a slow machine's compute must not turn a blend's hits into holes. A call is bounded by
    what is left when it starts (`bounding`): a Redis reply trickled over many socket reads is cut there."""

    seconds: float | None
    """None: no bound."""
    spent: float = 0.0

    def exhausted(self) -> bool:
        return self.seconds is not None and self.spent >= self.seconds

    def left_s(self) -> float | None:
        """Seconds left; None: no bound."""
        return None if self.seconds is None else self.seconds - self.spent

    def charge(self, seconds: float) -> None:
        self.spent += seconds  # one float add: the loader thread and the pass's thread may both charge

    @contextlib.contextmanager
    def bounding(self, clock: Callable[[], float]) -> Iterator[CallDeadline | None]:
        """The store calls this thread makes inside the block end by what is left of the budget now (a Redis
        call is cut mid-reply: cachefuse.call_deadline), and their time on `clock` is charged. Yields the
        deadline in force (None: no bound), whose `cut` says whether it ended a call; a call it cut spends
        the budget whole, since the budget is what the cut call was given."""
        start = clock()
        with call_deadline.calls_within(self.left_s(), clock) as deadline:
            try:
                yield deadline
            finally:
                self.charge(clock() - start)
                if deadline is not None and deadline.cut and self.seconds is not None:
                    self.spent = max(self.spent, self.seconds)


def was_cut(deadline: CallDeadline | None) -> bool:
    """Whether `deadline` (LoadBudget.bounding's) ended a call: its miss is "load_timeout", not the store's."""
    return deadline is not None and deadline.cut

@dataclass
class LoadFigures:
    """Time and bytes read per serving tier during one pass (the loading controller's samples)."""

    seconds: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def clear(self) -> None:
        self.seconds.clear()
        self.bytes.clear()


def serving_tier(store: KVStore) -> str:
    """The tier that served the store's last read (a tiered store says which)."""
    return getattr(store, "last_hit_tier", None) or getattr(store, "name", "store")


@dataclass
class EntryReader:
    """Reads chunk entries out of one store, timed by `clock`, checked against the model's layer count."""

    store: KVStore
    num_layers: int
    clock: Callable[[], float]
    budget: LoadBudget = field(default_factory=lambda: LoadBudget(None))
    """The blend's store time: no read starts once it is spent."""

    def timed_call(self, call: Callable[[], T]) -> T:
        """`call()` (one store call) within what is left of the budget, its time charged to it."""
        with self.budget.bounding(self.clock):
            return call()

    def budgeted_call(self, key: str, layer: int, call: Callable[[], T]) -> T:
        """`timed_call` of a read of `key` at `layer` during the pass; once the budget is spent, none:
        LayerUnavailable("load_timeout"), which reruns the pass with that chunk as a hole. A read the
        budget's deadline cut mid-reply is that miss too."""
        if self.budget.exhausted():
            raise LayerUnavailable(key, layer, MISS_LOAD_TIMEOUT)
        with self.budget.bounding(self.clock) as deadline:
            try:
                return call()
            except LayerUnavailable as exc:
                if was_cut(deadline):
                    raise LayerUnavailable(exc.key, exc.layer, MISS_LOAD_TIMEOUT) from None
                raise

    def timed(self, fetch: FetchLayer, figures: LoadFigures, keys: list[str]) -> FetchLayer:
        """`fetch` of `keys`, recording time and bytes by serving tier (on the loader thread; read after the
        pass), within the budget (`budgeted_call`, naming the first key)."""
        def timed_fetch(layer: int) -> LayerKV:
            start = self.clock()
            out = self.budgeted_call(keys[0], layer, lambda: fetch(layer)) if keys else fetch(layer)
            tier = serving_tier(self.store)
            figures.seconds[tier] += self.clock() - start
            figures.bytes[tier] += sum(k.nbytes + v.nbytes for k, v in out.values())
            return out
        return timed_fetch

    def present(self, key: str, miss_reasons: Counter) -> bool:
        """Whether `key` is stored, asked within the budget; when not, the miss is counted under its reason
        ("load_timeout": the budget was spent, so not asked: computed in full rather than waited for, and
        asking costs a call too; else "not_stored")."""
        if self.budget.exhausted():
            miss_reasons[MISS_LOAD_TIMEOUT] += 1
            return False
        with self.budget.bounding(self.clock) as deadline:
            found = self.store.contains(key)
        if not found:
            miss_reasons[MISS_LOAD_TIMEOUT if was_cut(deadline) else "not_stored"] += 1
        return found

    def read(self, segments: list[Segment], keys: dict[int, str], figures: LoadFigures
             ) -> tuple[dict[int, ChunkKV], Counter]:
        """Every declared chunk's whole entry (segment index -> entry) and the misses by reason. An entry
        whose shape does not fit its segment is removed: never right for a content-hashed key, the hole
        computed instead replaces it."""
        loaded, miss_reasons = {}, Counter()
        for index, key in keys.items():
            seg = segments[index]
            if not self.present(key, miss_reasons):
                continue
            before = dict(self.store.stats.misses)
            start = self.clock()
            with self.budget.bounding(self.clock) as deadline:
                entry = self.store.get(key)
            if entry is None:
                after = self.store.stats.misses
                new = [r for r in after if after[r] > before.get(r, 0) and r != "absent"]
                miss_reasons[MISS_LOAD_TIMEOUT if was_cut(deadline) else new[0] if new else "absent"] += 1
                continue
            tier = serving_tier(self.store)
            figures.seconds[tier] += self.clock() - start
            figures.bytes[tier] += entry.nbytes
            if entry.num_tokens != seg.length or entry.num_layers != self.num_layers:
                logger.warning("chunk %s: stored entry has %d tokens x %d layers, prompt needs %d x %d; "
                               "computing it as a hole", key, entry.num_tokens, entry.num_layers,
                               seg.length, self.num_layers)
                miss_reasons["length_mismatch"] += 1
                self.store.remove(key)
                continue
            loaded[index] = entry
        return loaded, miss_reasons


def keep_agreed_hits(loaded: dict[int, ChunkKV], miss_reasons: Counter, indices: list[int], hit_counts: list[float],
                     num_ranks: int) -> None:
    """A chunk stays loaded only where every tensor-parallel rank loaded it (`hit_counts`: per index of
    `indices`, how many ranks did, summed over them); the others compute it as a hole (reason
    "other_rank_missed"), so every rank recomputes the same rows."""
    for index, count in zip(indices, hit_counts, strict=True):
        if count != num_ranks and index in loaded:
            del loaded[index]
            miss_reasons["other_rank_missed"] += 1

"""Tier placement by access frequency: hot chunks move to faster tiers, cold ones leave them.

Imports cachefuse.loading.figures (TierFigures) and cachefuse.store. `AccessCounter` and
`placement_moves` are the pure policy (an injected clock, no I/O); `FrequencyPlacement` applies it to a
TieredStore. The worker owns the one instance (it is the store's single writer). With `placement="frequency"` the tiered store
stops promoting on every hit (`promote_on_hit=False`), and this policy decides instead: a chunk
whose decayed access count reaches `hot` is copied into the next faster tier; one that falls to
`cold` is dropped from its faster tier (the slower tier keeps it: puts write through). With
`placement="lru"` (the default) the faster tier is an LRU cache of the slower one and this policy
is not used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

from cachefuse.loading.figures import TierFigures
from cachefuse.store.tiered import TieredStore

logger = logging.getLogger(__name__)


class AccessCounter:
    """Per chunk key, access frequency with exponential decay (half-life in clock units)."""

    def __init__(self, half_life_s: float, clock: Callable[[], float]) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s={half_life_s!r} must be > 0")
        self.half_life_s, self.clock = half_life_s, clock
        self._score: dict[Hashable, tuple[float, float]] = {}  # key -> (score, at time)

    def _decayed(self, key: Hashable, now: float) -> float:
        score, at = self._score.get(key, (0.0, now))
        return score * 0.5 ** (max(0.0, now - at) / self.half_life_s)

    def record(self, key: Hashable) -> float:
        now = self.clock()
        score = self._decayed(key, now) + 1.0
        self._score[key] = (score, now)
        return score

    def frequency(self, key: Hashable) -> float:
        return self._decayed(key, self.clock())

    def forget(self, key: Hashable) -> None:
        self._score.pop(key, None)


def placement_moves(counter: AccessCounter, tiers_of_keys: Mapping[Hashable, str],
                    tiers: Sequence[TierFigures], hot_threshold: float,
                    cold_threshold: float) -> list[tuple[Hashable, str, str]]:
    """Moves (key, from_tier, to_tier): hot keys (frequency >= hot) one tier faster, cold ones
    (frequency <= cold) one tier slower. Pure: the worker applies them. Keys in unknown tiers stay.
    """
    if not cold_threshold < hot_threshold:
        raise ValueError(f"cold_threshold={cold_threshold!r} must be < hot_threshold={hot_threshold!r}")
    order = [t.name for t in sorted(tiers, key=lambda t: -t.bytes_per_s)]  # fastest first
    moves = []
    for key, name in tiers_of_keys.items():
        if name not in order:
            continue
        i, freq = order.index(name), counter.frequency(key)
        if freq >= hot_threshold and i > 0:
            moves.append((key, name, order[i - 1]))
        elif freq <= cold_threshold and i + 1 < len(order):
            moves.append((key, name, order[i + 1]))
    return moves


class FrequencyPlacement:
    """Applies placement_moves to a TieredStore (tiers fastest first, e.g. memory over disk).

    Args:
        store: the tiered store; its tiers' `name` attributes label them.
        hot, cold: decayed access counts that promote / demote (cold < hot).
        half_life_s: how fast counts decay, in `clock` units.
        clock: time source (injectable: tests never wait).
    """

    def __init__(self, store: TieredStore, hot: float, cold: float, half_life_s: float,
                 clock: Callable[[], float]) -> None:
        self.store, self.hot, self.cold = store, hot, cold
        self.counter = AccessCounter(half_life_s, clock)
        # Only the order matters to placement_moves: rank the tiers fastest first.
        count = len(store.tiers)
        self.tier_order = [TierFigures(tier.name, float(count - i)) for i, tier in enumerate(store.tiers)]
        self._by_name = {tier.name: tier for tier in store.tiers}
        self._known: set[str] = set()
        self._at_top: set[str] = set()
        """Hot keys last found in the fastest tier: nothing to do for them, so they are looked up only with
        lookups to spare (more than MAX_LOOKUPS of them had taken every lookup, every call: a cold key in
        memory was never demoted, a newly hot one on disk never promoted)."""

    def record(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.counter.record(key)
            self._known.add(key)

    MAX_LOOKUPS = 64
    """Keys whose tiers one `apply` looks up (a Redis round trip or a disk stat each, on the worker's
    forward path), the hottest and the coldest first; the rest wait for the next call."""

    def apply(self) -> list[tuple[str, str, str]]:
        """Performs this moment's moves; returns them as (key, from_tier, to_tier).

        Only keys that could move are looked up (hot, or cold), at most `MAX_LOOKUPS`; a cold key found in
        the slowest tier is forgotten (nothing left to do until it is used again), so the work per call
        stays bounded however many keys were ever loaded."""
        could_move = []
        for key in self._known:
            frequency = self.counter.frequency(key)
            if frequency >= self.hot or frequency <= self.cold:
                settled = key in self._at_top and frequency >= self.hot
                could_move.append((settled, -abs(frequency - (self.hot + self.cold) / 2), key, frequency))
        where = {}
        slowest = self.store.tiers[-1].name if self.store.tiers else None
        fastest_tier = self.store.tiers[0].name if self.store.tiers else None
        for _, _, key, frequency in sorted(could_move)[:self.MAX_LOOKUPS]:
            fastest = next((tier.name for tier in self.store.tiers if tier.contains(key)), None)
            if fastest is None or (fastest == slowest and frequency <= self.cold):
                self._known.discard(key)  # evicted everywhere, or cold where it belongs: nothing to place
                self._at_top.discard(key)
                self.counter.forget(key)
                continue
            where[key] = fastest
            if fastest == fastest_tier and frequency >= self.hot:
                self._at_top.add(key)
            else:
                self._at_top.discard(key)
        moves = placement_moves(self.counter, where, self.tier_order, self.hot, self.cold)
        done = []
        for key, source, target in moves:
            if self._move(key, self._by_name[source], self._by_name[target]):
                done.append((key, source, target))
        return done

    def _would_evict_a_hot_entry(self, key: str, source, target) -> bool:
        """Whether putting `key` (its size as `source` stores it) into `target` would evict a hot entry, or
        cannot fit at all: asked of the target's own eviction plan before the entry is read, so a refused
        promotion costs no read. Entries the placement never saw read (saves) count as cold, so a tier
        filled by saves still takes hot entries. Sizes are the source's (file bytes, header included, from
        disk and Redis): a little over what a memory tier counts, so a promotion errs towards refusing.
        Without an answer (a tier with no `plan_put`, a size the source cannot give) it is promoted."""
        size_of, plan_put = getattr(source, "size_of", None), getattr(target, "plan_put", None)
        size = size_of(key) if size_of is not None else None
        if size is None or plan_put is None:
            return False
        victims = plan_put(key, size)
        return victims is None or any(self.counter.frequency(victim) >= self.hot for victim in victims)

    def _move(self, key: str, source, target) -> bool:
        order = [tier.name for tier in self.store.tiers]
        if order.index(target.name) < order.index(source.name):  # promotion
            if self._would_evict_a_hot_entry(key, source, target):
                return False  # with more hot entries than room, each copy evicted another, every call
            entry = source.get(key)
            return entry is not None and target.put(key, entry)
        if not target.contains(key):  # demoting the only copy: write it below first
            entry = source.get(key)
            if entry is None or not target.put(key, entry):
                return False
        source.remove(key)
        return True

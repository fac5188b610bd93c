"""Chunk variants end to end on the reference engine: choice by CFO, saving, f_r, N x M eviction, staleness.

The rules under test are cachefuse/metadata/index.py's docstring; the metadata math is tests/metadata/test_scores.py's.
"""

from __future__ import annotations

import threading

import pytest
import torch

from cachefuse.config import CacheFuseConfig
from cachefuse.errors import StoreError
from cachefuse.metadata import scores
from cachefuse.metadata.base import VariantRecord, make_variant_id, variant_store_key
from cachefuse.metadata.index import Admission, VariantIndex, new_prefixes, plan_variants
from cachefuse.metadata.refresher import IndexRefresher
from cachefuse.metadata.sqlite import SqliteMetaStore
from tests.helpers.fusion import make_case, make_engine, precompute_case


def prompt(case, order: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The case's system, its pieces in `order`, then its question; declared chunks' offsets."""
    ids, chunks = list(case.system), [(0, len(case.system))]
    for i in order:
        chunks.append((len(ids), len(ids) + len(case.pieces[i])))
        ids += case.pieces[i]
    return ids + case.question, chunks


# --------------------------------------------------------------------------- the index, no model


def test_new_prefix_excludes_the_system_chunk():
    assert new_prefixes(["S", "A", "B", "C"], [True, False, False, False]) == [(), (), ("A",), ("A", "B")]
    assert new_prefixes(["A", "B"], [False, False]) == [(), ("A",)]


def test_new_prefix_keeps_the_nearest_chunks_when_capped():
    keys, system = ["S", "A", "B", "C", "D"], [True, False, False, False, False]
    assert new_prefixes(keys, system, 2) == [(), (), ("A",), ("A", "B"), ("B", "C")]
    assert new_prefixes(keys, system, 0) == [()] * 5
    assert new_prefixes(keys, system, None) == new_prefixes(keys, system, 99)


def test_a_hole_after_more_chunks_than_the_cap_records_the_nearest_ones(adapter):
    engine = make_engine(adapter, CacheFuseConfig(max_variant_prefix_chunks=1))
    case = make_case(adapter.shape.vocab_size, seed=22)
    precompute_case(engine, case)  # B is the hole, after A
    engine.precompute([case.pieces[1]], prefix_ids=case.system)  # now C is the hole, after A and B
    engine.store.remove(engine.key(case.pieces[2]))
    for record in engine.metastore.variants(engine.key(case.pieces[2])):
        engine.metastore.remove(record.variant_id)
    _, stats = engine.prefill(*prompt(case, [0, 1, 2]), selector="cacheblend", ratio=0.15)
    (c_variant,) = engine.metastore.variants(engine.key(case.pieces[2]))
    assert c_variant.prefix == (engine.key(case.pieces[1]),)  # B only: the nearest chunk before C
    _, again = engine.prefill(*prompt(case, [0, 1, 2]), selector="cacheblend", ratio=0.15)
    assert again.chunk_cfo[3] == 0.0  # planned with the same cap: an exact match


def test_index_picks_lowest_cfo_and_plain_keys_are_base_variants():
    after_ab = VariantRecord(chunk_key="C", prefix=("A", "B"), inter={"A": 1.0, "B": 3.0}, intra=2.0,
                             num_tokens=4, prefix_num_tokens={"A": 2, "B": 2}, ranked_tokens=(2, 0, 1, 3))
    alone = VariantRecord.without_stats("C", (), 4)
    index = VariantIndex([alone, after_ab], plain_keys=["P"])
    chosen = index.choose("C", ("B", "A"), alpha=1.0, num_tokens=4)  # swapped prefix: beta 1, gamma 1
    expected_swapped = scores.cfo(1.0, after_ab.cci, 1.0, 1.0)
    assert expected_swapped == pytest.approx(after_ab.cci)  # beta' = 0: no better than the base variant...
    # ... whose CCI is 0.5 < after_ab.cci, so the base variant (lower CFO) wins
    assert chosen.variant_id == alone.variant_id and chosen.cfo == pytest.approx(0.5)
    exact = index.choose("C", ("A", "B"), alpha=1.0, num_tokens=4)  # the same prefix: CFO 0
    assert exact.variant_id == after_ab.variant_id and exact.cfo == 0.0 and exact.ranked_tokens == (2, 0, 1, 3)
    assert exact.store_key == variant_store_key("C", ("A", "B")) == f"C-{make_variant_id('C', ('A', 'B'))}"
    plain = index.choose("P", ("A",), alpha=1.0, num_tokens=3)  # rule 3: no metadata row
    assert plain.store_key == "P" and not plain.has_metadata and plain.cfo == pytest.approx(0.5)
    assert index.choose("nope", (), 1.0, 3) is None and "P" in index and "C" in index and "nope" not in index
    index.remove(alone.variant_id)
    assert [r.variant_id for r in index.variants("C")] == [after_ab.variant_id]


def test_choices_say_which_tiers_hold_their_kv():
    """Rule 6: a record's home tier, plus the tier a listing found its key in; nothing claims memory."""
    on_redis = VariantRecord.without_stats("R", (), 4, tier="redis")
    on_disk = VariantRecord.without_stats("D", (), 4)  # the default home tier: "disk"
    index = VariantIndex([on_redis, on_disk], plain_keys=["R", "P"], plain_tier="disk")
    assert index.choose("R", (), 1.0, 4).tiers == ("redis", "disk")  # also listed on the local disk
    assert index.choose("D", (), 1.0, 4).tiers == ("disk",)
    assert index.choose("P", (), 1.0, 4).tiers == ("disk",)  # rule 3: the listing alone
    index.add_plain_keys(["P", "U"])  # e.g. keys the worker reports saving: where is not known
    assert index.choose("P", (), 1.0, 4).tiers == ("disk",)  # a tier already known stays
    assert index.choose("U", (), 1.0, 4).tiers == ()
    index.replace_all([on_disk], ["R"], "disk")  # a reload: R's record is gone, its disk entry listed
    assert index.choose("R", (), 1.0, 4).tiers == ("disk",) and "U" not in index
    index.replace_all([on_disk])  # no listing: the known plain keys and their tiers stay
    assert index.choose("R", (), 1.0, 4).tiers == ("disk",)


def test_admission_cfo_computes_a_poorly_matching_chunk_in_full():
    base = VariantRecord.without_stats("C", (), 4)
    index = VariantIndex([base, VariantRecord.without_stats("S", (), 2)])
    keys, system = ["S", "A", "C"], [True, False, False]
    kept = plan_variants(index, keys, system, [2, 3, 4], alpha=1.0, admission=None)
    assert [c and c.chunk_key for c in kept] == ["S", None, "C"]  # A has no variant: a hole
    assert plan_variants(index, keys, system, [2, 3, 4], alpha=1.0, admission=Admission(0.6))[2] is not None  # 0.5 < 0.6
    refused = plan_variants(index, keys, system, [2, 3, 4], alpha=1.0, admission=Admission(0.5))
    assert refused[0] is not None and refused[2] is None  # CFO 0.5 >= 0.5: computed, becomes C after (A,)
    # the system chunk keeps its base variant whatever the threshold (it never moves)
    assert plan_variants(index, keys, system, [2, 3, 4], alpha=1.0, admission=Admission(0.0))[0] is not None


# --------------------------------------------------------------------------- the reference engine


def test_hole_becomes_the_variant_for_its_prefix_and_is_chosen_by_cfo(adapter):
    engine = make_engine(adapter, CacheFuseConfig(collect_attention_stats=True))
    case = make_case(adapter.shape.vocab_size, seed=21)
    precompute_case(engine, case)  # system, A and C alone; B a hole
    key_a, key_b, key_c = (engine.key(p) for p in case.pieces)
    ids, chunks = prompt(case, [0, 1, 2])
    _, first = engine.prefill(ids, chunks, selector="cacheblend", ratio=0.15)
    # system and A (nothing before it) reuse their base variants exactly; B is computed in full; C's
    # base variant after a non-empty prefix has beta 0, so CFO = alpha * CCI = 0.5
    assert first.chunk_cfo == [0.0, 0.0, None, pytest.approx(0.5)]
    (b_variant,) = engine.metastore.variants(key_b)
    assert b_variant.prefix == (key_a,) and b_variant.has_stats and 0.5 <= b_variant.cci < 1.0
    assert first.saved_keys == (b_variant.store_key,)

    # Same order again: B's variant matches its prefix exactly (CFO 0) and its f_r grows by 1/eps.
    _, second = engine.prefill(ids, chunks, selector="cacheblend", ratio=0.15)
    assert second.chunks_missed == 0 and second.chunk_cfo[2] == 0.0
    assert engine.metastore.get(b_variant.variant_id).access_count == 1
    assert engine.metastore.get(b_variant.variant_id).f_r == pytest.approx(1e6)
    base_c = engine.metastore.variants(key_c)[0]
    assert base_c.access_count == 2 and base_c.f_r == pytest.approx(2 / 0.5)

    # C first: B's variant after (A) keeps beta 1 (A still precedes it), gamma 0 -> CFO 0
    ids2, chunks2 = prompt(case, [2, 0, 1])
    _, third = engine.prefill(ids2, chunks2, selector="cacheblend", ratio=0.15)
    assert third.chunks_missed == 0 and third.chunk_cfo[3] == 0.0 and third.holes_saved == 0
    # B first: A is not in its prefix any more, beta 0 -> CFO = CCI
    ids3, chunks3 = prompt(case, [1, 0, 2])
    _, fourth = engine.prefill(ids3, chunks3, selector="cacheblend", ratio=0.15)
    assert fourth.chunk_cfo[1] == pytest.approx(b_variant.cci)


def test_admission_threshold_stores_a_second_variant_and_then_prefers_it(adapter):
    engine = make_engine(adapter, CacheFuseConfig(variant_admission_cfo=0.5, variant_admission_max_chunks=2))
    case = make_case(adapter.shape.vocab_size, seed=22)
    precompute_case(engine, case, with_hole=False)  # A, B, C all stored alone
    key_b = engine.key(case.pieces[1])
    ids, chunks = prompt(case, [0, 1, 2])
    _, first = engine.prefill(ids, chunks, selector="cacheblend", ratio=0.15)
    # B and C have CFO 0.5 (base variants after a prefix): computed in full, stored for their prefixes
    assert first.chunk_cfo == [0.0, 0.0, None, None]
    assert first.holes_saved == 2 and len(engine.metastore.variants(key_b)) == 2
    _, second = engine.prefill(ids, chunks, selector="cacheblend", ratio=0.15)
    assert second.chunk_cfo[2:] == [0.0, 0.0] and second.holes_saved == 0 and second.chunks_missed == 0


def test_n_x_m_budget_evicts_lowest_f_r_and_deletes_its_kv(adapter):
    engine = make_engine(adapter, CacheFuseConfig(max_variants=3))
    case = make_case(adapter.shape.vocab_size, seed=23)
    engine.precompute([case.system])
    engine.precompute([case.pieces[0]], prefix_ids=case.system)  # system + A: 2 variants
    key_a = engine.key(case.pieces[0])
    ids, chunks = prompt(case, [0, 1])  # B a hole: 3rd variant
    engine.prefill(ids, chunks, selector="full_reuse")
    engine.prefill(ids, chunks, selector="full_reuse")  # every variant used once more: f_r > 0
    assert engine.metastore.count() == 3
    ids2, chunks2 = prompt(case, [0, 2])  # C a hole: the budget is full, the lowest f_r goes
    f_r = {r.variant_id: r.f_r for r in engine.metastore.all_records()}
    victim = min(f_r, key=f_r.get)
    _, stats = engine.prefill(ids2, chunks2, selector="full_reuse")
    assert engine.metastore.count() == 3 and stats.holes_saved == 1
    assert stats.evicted_variants == (victim,) and engine.metastore.get(victim) is None
    evicted_record = [r for r in (VariantRecord.without_stats(key_a, (), 1),) if r.variant_id == victim]
    assert set(engine.store.keys()) == {r.store_key for r in engine.metastore.all_records()}  # K/V went too
    assert not evicted_record or not engine.store.contains(evicted_record[0].store_key)


def test_full_store_of_pinned_variants_refuses_the_hole_and_keeps_serving(adapter):
    engine = make_engine(adapter, CacheFuseConfig(max_variants=2))
    case = make_case(adapter.shape.vocab_size, seed=24)
    engine.precompute([case.system])
    engine.precompute([case.pieces[0]], prefix_ids=case.system)
    for record in engine.metastore.all_records():
        engine.metastore.pin(record.variant_id)  # another request holds them
    ids, chunks = prompt(case, [0, 1])
    _, stats = engine.prefill(ids, chunks, selector="full_reuse")
    assert stats.holes_saved == 0 and stats.save_failures == 1 and engine.metastore.count() == 2
    assert len(engine.store.keys()) == 2  # the refused hole's K/V were not left behind


def test_stale_metadata_is_a_miss_and_the_hole_restores_it(adapter):
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=25)
    precompute_case(engine, case, with_hole=False)
    key_a, key_b = engine.key(case.pieces[0]), engine.key(case.pieces[1])
    engine.store.remove(key_b)  # its K/V vanished (another tier's byte budget, an operator)
    ids, chunks = prompt(case, [1, 0, 2])  # B first: its base variant is the pair (B, ()) again
    baseline = make_engine(adapter)
    precompute_case(baseline, case, with_hole=True)
    want, _ = baseline.prefill(ids, chunks, selector="cacheblend", ratio=0.15, save_holes=False)
    got, stats = engine.prefill(ids, chunks, selector="cacheblend", ratio=0.15, save_holes=False)
    assert stats.chunks_missed == 1 and stats.miss_reasons == {"not_stored": 1}
    assert torch.equal(got.logits, want.logits)  # the same as a store that never had it
    (row,) = engine.metastore.variants(key_b)  # kept, stale (cachefuse inspect lists it), not counted as a use
    assert row.access_count == 0 and not engine.store.contains(row.store_key)
    _, again = engine.prefill(ids, chunks, selector="cacheblend", ratio=0.15)  # saving on: the hole re-saves it
    assert again.holes_saved == 1 and engine.store.contains(key_b) and len(engine.metastore.variants(key_b)) == 1
    _, hit = engine.prefill(ids, chunks, selector="cacheblend", ratio=0.15)
    assert hit.chunks_missed == 0 and key_a in engine.store.keys()


def test_random_workload_keeps_budget_and_kv_in_step_with_metadata(adapter):
    """N x M holds after every request, and the K/V tier holds exactly the variants the metadata lists."""
    engine = make_engine(adapter, CacheFuseConfig(max_variants=4))
    case = make_case(adapter.shape.vocab_size, seed=26)
    engine.precompute([case.system])
    g = torch.Generator().manual_seed(0)
    for _ in range(8):
        order = torch.randperm(3, generator=g)[: 1 + int(torch.randint(3, (1,), generator=g))].tolist()
        ids, chunks = prompt(case, order)
        engine.prefill(ids, chunks, selector="full_reuse")
        assert engine.metastore.count() <= 4
        assert set(engine.store.keys()) == {r.store_key for r in engine.metastore.all_records()}


# --------------------------------------------------------------------------- the refresher


class FlakyStore:
    """A MetaStore double for the refresher: generation and records, failing while `down` is set."""

    def __init__(self) -> None:
        self.records, self.gen, self.down = [], 0, threading.Event()

    def generation(self) -> int:
        if self.down.is_set():
            raise StoreError("down")
        return self.gen

    def all_records(self):
        return list(self.records)

    def variant_versions(self):
        return [(r.variant_id, (r.last_access, r.f_r, r.access_count)) for r in self.records]

    def get_many(self, variant_ids):
        wanted = set(variant_ids)
        return [r for r in self.records if r.variant_id in wanted]

    def close(self) -> None:
        pass


def test_refresher_reloads_on_generation_change_and_survives_errors(tmp_path):
    store = SqliteMetaStore(str(tmp_path / "meta.sqlite"), max_variants=10)
    index = VariantIndex()
    refresher = IndexRefresher(index, lambda: store, interval_s=3600)
    assert refresher.refresh_once(store) and len(index) == 0
    assert not refresher.refresh_once(store)  # nothing changed: no reload
    store.put(VariantRecord.without_stats("K", (), 3))
    assert refresher.refresh_once(store) and "K" in index and refresher.reloads == 2
    listing = IndexRefresher(index, lambda: store, interval_s=3600, plain_keys=lambda: ["L"], plain_tier="disk")
    assert listing.refresh_once(store) and index.choose("L", (), 1.0, 2).tiers == ("disk",)

    flaky = FlakyStore()
    flaky.records = [VariantRecord.without_stats("J", (), 2)]
    flaky.gen = 1
    index2 = VariantIndex()
    background = IndexRefresher(index2, lambda: flaky, interval_s=0.01).start()
    try:
        for _ in range(500):
            if "J" in index2:
                break
            threading.Event().wait(0.01)
        assert "J" in index2
        flaky.down.set()  # an outage: the snapshot stays, errors are counted, the thread lives on
        for _ in range(500):
            if background.errors:
                break
            threading.Event().wait(0.01)
        assert background.errors >= 1 and "J" in index2
        flaky.down.clear()
        flaky.records, flaky.gen = [VariantRecord.without_stats("Q", (), 2)], 2
        for _ in range(500):
            if "Q" in index2:
                break
            threading.Event().wait(0.01)
        assert "Q" in index2 and "J" not in index2
    finally:
        background.stop()


class DuringRead(FlakyStore):
    """A snapshot read during which something happens (the scheduler's thread, racing the refresher)."""

    def __init__(self, on_read) -> None:
        super().__init__()
        self.on_read = on_read

    def all_records(self):
        records = list(self.records)
        self.on_read()
        return records

    def variant_versions(self):  # an incremental reload's snapshot is its version listing
        versions = super().variant_versions()
        self.on_read()
        return versions


def test_announced_variants_outlive_reloads_until_written_and_seen():
    """The worker announces a hole at submit and writes it later; a reload in between must not forget it
    (the next request would recompute a chunk it could load), while a plain add is a snapshot's to drop."""
    store = FlakyStore()
    index = VariantIndex()
    refresher = IndexRefresher(index, lambda: store, interval_s=3600, plain_keys=lambda: ["L"], plain_tier="disk")
    queued = VariantRecord.without_stats("Q", ("A",), 4)
    unannounced = VariantRecord.without_stats("U", ("A",), 4)
    index.announce([queued], [queued.store_key])
    index.add(unannounced)  # negative control: not announced, so only the snapshot speaks for it
    store.gen = 1
    assert refresher.refresh_once(store)
    assert index.variants("Q") == [queued] and index.variants("U") == [] and index.choose("L", (), 1.0, 2)

    index.confirm_written([queued.store_key])
    store.records, store.gen = [queued], 2  # written, and the next snapshot holds it
    assert refresher.refresh_once(store) and index.variants("Q") == [queued]
    store.records, store.gen = [], 3  # then evicted elsewhere (another engine): the snapshot decides
    assert refresher.refresh_once(store) and index.variants("Q") == []

    gone = VariantRecord.without_stats("G", ("A",), 4)
    index.announce([gone], [gone.store_key])
    index.confirm_written([gone.store_key])  # written, then removed before any reload saw it
    store.gen = 4
    assert refresher.refresh_once(store) and index.variants("G") == [] and gone.store_key not in index


def test_a_reload_honours_what_changed_while_its_snapshot_was_read():
    removed = VariantRecord.without_stats("R", (), 4)
    confirmed = VariantRecord.without_stats("C", ("A",), 4)
    index = VariantIndex([removed])
    index.announce([confirmed])

    def scheduler_step():  # the worker reports R evicted and C written while the refresher reads
        index.remove(removed.variant_id)
        index.confirm_written([confirmed.store_key])

    store = DuringRead(scheduler_step)
    store.records, store.gen = [removed], 1  # read before the eviction; C's row not in it yet
    refresher = IndexRefresher(index, lambda: store, interval_s=3600)
    assert refresher.refresh_once(store)
    assert index.variants("R") == []  # the eviction is not undone by the older snapshot
    assert index.variants("C") == [confirmed]  # written after the read began: this snapshot cannot know
    store.on_read, store.records, store.gen = (lambda: None), [], 2
    assert refresher.refresh_once(store) and index.variants("C") == []  # the next one decides


def test_an_index_without_a_refresher_forgets_written_keys_with_their_variants():
    """Without a disk tier or Redis no refresher runs, and the keys the worker reported written were only
    ever dropped by a snapshot: one key kept per hole ever saved, evicted or not."""
    index = VariantIndex()
    for i in range(200):
        record = VariantRecord.without_stats(f"chunk{i}", (), 10)
        index.announce([record], [record.store_key])  # queued for the writer
        index.confirm_written([record.store_key])  # written
        if i % 2:
            index.remove(record.variant_id)  # evicted under the N x M budget
    assert len(index) == 100 and len(index._written) == 100 and not index._expiring
    assert len(index._announced_plain) == 100

"""Hole saves behind the request (cachefuse/fusion/saving.py):

- a store whose writes block never blocks a prefill saving in the background (inline, the same prefill
  would wait: the negative control); the queued hole reads as stored at once, and the next prefill
  reuses it with the output of an engine that saved inline;
- a full queue skips the save and counts it, without waiting; the same hole queued twice is written once;
  the queue's depth (holes, bytes, bound) says what waits, and nothing once written;
- a save that fails after it was announced comes back as a failure and an eviction of its variant id,
  unless the hole was queued again before the report was taken; a writer that raises keeps writing the
  next save; a written save is reported as written;
- a reuse of a queued variant is recorded on its row once the row is written (before, it has no row);
- close() writes what is queued (flush), reports what it could not within its bound, refuses later saves;
- metadata evictions made by the writer reach take_report, with their K/V deleted.
"""

from __future__ import annotations

import threading

import pytest
import torch

from cachefuse.adapters.hf import HFAdapter
from cachefuse.config import CacheFuseConfig
from cachefuse.fusion.background_saver import BackgroundSaver, PendingReadsStore, QueueDepth
from cachefuse.fusion.engine import FusionEngine
from cachefuse.fusion.saving import HoleSave, HoleWriter
from cachefuse.metadata.base import VariantRecord
from cachefuse.metadata.sqlite import SqliteMetaStore
from cachefuse.store.base import ChunkKV, StoreIdentity
from cachefuse.store.memory import MemoryStore
from tests.helpers.fusion import make_case, make_engine

SEED = 5
WAIT_S = 60.0  # a bound on waits for the writer thread; never reached when the code is right


class GatedStore(MemoryStore):
    """A memory store whose puts wait for `gate` (a slow disk, a stalled network), and can be told to fail."""

    def __init__(self, identity: StoreIdentity) -> None:
        super().__init__(identity, capacity_bytes=1 << 30)
        self.gate = threading.Event()
        self.refuse = False
        self.raise_once = False

    def put(self, key: str, entry: ChunkKV) -> bool:
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        if self.raise_once:
            self.raise_once = False
            raise OSError("disk vanished")
        return False if self.refuse else super().put(key, entry)


@pytest.fixture(scope="module")
def case(adapter):
    return make_case(adapter.shape.vocab_size, seed=SEED)


def _gated_engine(adapter: HFAdapter, max_bytes: int = 1 << 30) -> tuple[FusionEngine, GatedStore]:
    engine = make_engine(adapter)
    store = GatedStore(engine.store.identity)
    engine.store = store
    engine.save_in_background(max_bytes, flush_timeout_s=WAIT_S)
    return engine, store


def _entry(num_tokens: int = 4, num_layers: int = 2, fill: float = 1.0) -> ChunkKV:
    return ChunkKV([torch.full((num_tokens, 1, 4), fill) for _ in range(num_layers)],
                   [torch.full((num_tokens, 1, 4), fill) for _ in range(num_layers)])


def _save(key: str, nbytes_tokens: int = 4) -> HoleSave:
    return HoleSave(key, VariantRecord.without_stats(key, (), nbytes_tokens), _entry(nbytes_tokens))


def _saver(store, max_bytes: int, metastore=None, clock=None) -> BackgroundSaver:
    metastore = metastore or SqliteMetaStore(":memory:", max_variants=100)
    kwargs = {} if clock is None else {"clock": clock}
    return BackgroundSaver(HoleWriter(store, metastore, True, "memory"), max_bytes, WAIT_S, **kwargs)


def _identity() -> StoreIdentity:
    return StoreIdentity("test", 2, torch.float32)


def test_prefill_never_waits_for_the_store_and_the_queued_hole_is_reused_at_once(adapter, case):
    engine, store = _gated_engine(adapter)
    store.gate.set()
    engine.precompute([case.system])
    engine.precompute(case.pieces[1:], prefix_ids=case.system)  # chunk A is missing: a hole
    store.gate.clear()
    _, stats = engine.prefill(case.token_ids, case.chunks)  # the gate is shut: an inline save would hang
    saved = stats.saved_keys[0]
    assert stats.holes_saved == 1 and stats.saves_skipped == 0 and not store.contains(saved)
    assert engine.store.contains(saved) and engine.saver.pending_bytes > 0

    again, hits = engine.prefill(case.token_ids, case.chunks, selector="full_reuse")  # served from the queue
    assert (hits.chunks_hit, hits.chunks_missed, hits.holes_saved) == (4, 0, 0)
    inline = make_engine(adapter)
    inline.precompute([case.system])
    inline.precompute(case.pieces[1:], prefix_ids=case.system)
    inline.prefill(case.token_ids, case.chunks)
    want, _ = inline.prefill(case.token_ids, case.chunks, selector="full_reuse")
    torch.testing.assert_close(again.logits, want.logits, atol=0, rtol=0)

    store.gate.set()
    assert engine.saver.flush(WAIT_S) and store.contains(saved) and engine.metastore.count() >= 1
    report = engine.take_save_report()  # announced at submit; now only that it was written
    assert report.written == [saved] and not (report.failures or report.evicted or report.saved_keys)
    (variant_id,) = [r.variant_id for r in engine.metastore.all_records() if r.store_key == saved]
    assert engine.metastore.get(variant_id).access_count == 1  # the reuse while queued, recorded once written


def test_inline_saving_waits_for_the_store(adapter, case):
    """Negative control: without the background saver, the same prefill does not return while the put waits."""
    engine = make_engine(adapter)
    store = GatedStore(engine.store.identity)
    engine.store = store  # empty: every chunk is a hole
    done = threading.Event()
    thread = threading.Thread(target=lambda: (engine.prefill(case.token_ids, case.chunks), done.set()), daemon=True)
    thread.start()
    assert not done.wait(0.5)  # still inside the first put
    store.gate.set()
    thread.join(WAIT_S)
    assert done.is_set()


def test_full_queue_skips_and_counts_without_waiting():
    store = GatedStore(_identity())
    saver = _saver(store, max_bytes=_entry().nbytes * 2)
    first = saver.submit([_save("a" * 16), _save("b" * 16), _save("c" * 16)])  # room for two
    assert first.saved_keys == ["a" * 16, "b" * 16] and first.skipped == 1
    assert saver.submit([_save("a" * 16)]).is_empty()  # queued already: written once
    nbytes = _entry().nbytes
    assert saver.queue_depth() == QueueDepth(2, 2 * nbytes, 2 * nbytes)  # the skipped one is not waiting
    store.gate.set()
    assert saver.flush(WAIT_S)
    assert saver.queue_depth() == QueueDepth(0, 0, 2 * nbytes)
    assert sorted(store.keys()) == ["a" * 16, "b" * 16] and store.stats.puts == 2
    assert saver.submit([_save("c" * 16)]).saved_keys == ["c" * 16]  # room again
    assert saver.close() == 0 and store.contains("c" * 16)


def test_a_save_that_fails_later_is_reported_and_the_writer_survives_an_exception():
    store = GatedStore(_identity())
    saver = _saver(store, max_bytes=1 << 20)
    store.raise_once = True
    announced = saver.submit([_save("a" * 16), _save("b" * 16)])
    assert announced.saved_keys == ["a" * 16, "b" * 16]
    store.gate.set()
    assert saver.flush(WAIT_S)
    report = saver.take_report()
    record_a = announced.records[0]
    assert report.failures == 1 and report.evicted == [record_a.variant_id]  # the index forgets "a"
    assert store.keys() == ["b" * 16]  # written after the failure
    store.refuse = True
    saver.submit([_save("c" * 16)])
    assert saver.flush(WAIT_S) and saver.take_report().failures == 1 and not store.contains("c" * 16)


def test_a_hole_queued_again_after_its_save_failed_is_not_forgotten():
    """The failure and the new announcement reach the scheduler in one step (the report is taken once per
    step): the later announcement wins, or the index would forget a variant the writer is about to write."""
    store = GatedStore(_identity())
    saver = _saver(store, max_bytes=1 << 20)
    store.refuse = True
    store.gate.set()
    variant_id = saver.submit([_save("a" * 16)]).records[0].variant_id
    assert saver.flush(WAIT_S)
    store.refuse = False
    assert saver.submit([_save("a" * 16)]).saved_keys == ["a" * 16]  # the same hole, computed again
    assert saver.flush(WAIT_S)
    report = saver.take_report()
    assert report.failures == 1 and report.evicted == [] and report.written == ["a" * 16]
    assert store.contains("a" * 16)

    # Negative control: taken before the hole is queued again, the failure still says "forget it".
    store.refuse = True
    saver.submit([_save("a" * 16)])  # "a" is written: the writer finds it and stops (not a failure)
    variant_b = saver.submit([_save("b" * 16)]).records[0].variant_id
    assert saver.flush(WAIT_S)
    failed = saver.take_report()
    assert failed.failures == 1 and failed.evicted == [variant_b] and variant_id not in failed.evicted


def test_reuses_of_a_queued_variant_are_recorded_once_its_row_is_written():
    store = GatedStore(_identity())
    metastore = SqliteMetaStore(":memory:", max_variants=100)
    saver = _saver(store, max_bytes=1 << 20, metastore=metastore)
    variant_id = saver.submit([_save("a" * 16)]).records[0].variant_id
    other = VariantRecord.without_stats("c" * 16, (), 4)
    metastore.put(other)
    assert metastore.record_uses([(variant_id, 0.0)]) == 0  # negative control: no row yet, the use is lost
    rest = saver.defer_uses([(variant_id, 0.0), (other.variant_id, 0.5)])
    assert rest == [(other.variant_id, 0.5)]  # written already: the caller records it
    store.gate.set()
    assert saver.flush(WAIT_S)  # returns once the deferred use is on the row
    assert metastore.get(variant_id).access_count == 1
    assert saver.defer_uses([(variant_id, 0.0)]) == [(variant_id, 0.0)]  # written: no longer deferred


def test_close_writes_the_queue_and_reports_what_it_could_not():
    store = GatedStore(_identity())
    saver = _saver(store, max_bytes=1 << 20)
    saver.submit([_save("a" * 16)])
    store.gate.set()
    assert saver.close() == 0 and store.contains("a" * 16)
    assert saver.submit([_save("b" * 16)]).skipped == 1  # closed: nothing queued behind shutdown

    stuck = GatedStore(_identity())
    ticks = iter(range(10**6))
    stalled = _saver(stuck, max_bytes=1 << 20, clock=lambda: float(next(ticks)))
    stalled.submit([_save("a" * 16), _save("b" * 16)])
    assert stalled.close(timeout_s=3.0) == 2  # the put never returns within the bound
    stuck.gate.set()
    stalled._thread.join(WAIT_S)
    assert not stalled._thread.is_alive()
    # "a" was being written and finishes; "b", still queued at the deadline, is dropped rather than
    # written behind a closed metadata store.
    assert stuck.keys() == ["a" * 16]


def test_pending_reads_serve_queued_entries_and_removal_drops_them():
    store = GatedStore(_identity())
    saver = _saver(store, max_bytes=1 << 20)
    view = PendingReadsStore(store, saver)
    saver.submit([_save("a" * 16), _save("b" * 16)])
    assert view.contains("a" * 16) and view.get("a" * 16) is not None and not store.contains("a" * 16)
    assert set(view.keys()) == {"a" * 16, "b" * 16}
    view.remove("b" * 16)  # still queued (the gate holds "a" in the writer): never written
    store.gate.set()
    assert saver.flush(WAIT_S) and store.keys() == ["a" * 16]
    assert view.get("a" * 16) is not None and view.last_hit_tier is None  # now the store's own


def test_metadata_evictions_made_by_the_writer_reach_the_report():
    store = MemoryStore(_identity(), capacity_bytes=1 << 20)
    metastore = SqliteMetaStore(":memory:", max_variants=1)
    saver = _saver(store, max_bytes=1 << 20, metastore=metastore)
    first = saver.submit([_save("a" * 16)])
    assert saver.flush(WAIT_S)
    saver.submit([_save("b" * 16)])  # the budget holds one variant: "a" goes
    assert saver.flush(WAIT_S)
    report = saver.take_report()
    assert report.evicted == [first.records[0].variant_id] and store.keys() == ["b" * 16]
    assert saver.close() == 0


def test_background_engine_config_and_close(adapter, case):
    engine = FusionEngine(adapter, MemoryStore(StoreIdentity("m", adapter.shape.num_layers, torch.float32), 1 << 30),
                          make_engine(adapter).key_context, CacheFuseConfig())
    engine.save_in_background(1 << 20)
    with pytest.raises(RuntimeError, match="already"):
        engine.save_in_background(1 << 20)
    _, stats = engine.prefill(case.token_ids, case.chunks)
    assert stats.holes_saved == len(case.chunks)
    assert engine.close() == 0 and set(engine.store.inner.keys()) == set(stats.saved_keys)


def test_with_no_prefix_chunks_kept_only_base_variants_are_saved(adapter, case):
    """max_variant_prefix_chunks: 0 cut every hole's prefix to nothing, so a hole after other chunks was
    stored under the plain key as if computed after the system prompt alone, and later reused as exact."""
    engine = make_engine(adapter, CacheFuseConfig(max_variant_prefix_chunks=0))
    _, stats = engine.prefill(case.token_ids, case.chunks, save_inline=True)  # a cold store: every chunk a hole
    system, first = engine.key(case.system, at_prompt_start=True), engine.key(case.pieces[0])
    assert set(stats.saved_keys) == {system, first}  # after the system prompt alone: the base variants
    for piece in case.pieces[1:]:
        assert not engine.store.contains(engine.key(piece))


@pytest.mark.parametrize("row", ["another engine's", "none", "unknown"])
def test_a_refused_row_removes_the_k_v_only_when_no_row_points_at_them(row):
    """The metadata put fails (a timeout whose script may have landed, a connection dropped): removing the
    K/V then left a row another engine had written for the same variant meanwhile pointing at nothing, a
    miss for every engine. They are removed only when the store says no row exists."""
    from cachefuse.errors import StoreError

    store = MemoryStore(_identity(), capacity_bytes=1 << 20)
    metastore = SqliteMetaStore(":memory:", max_variants=100)
    save = _save("a" * 16)
    writer = HoleWriter(store, metastore, True, "memory")
    real_get, gets = metastore.get, []

    def put(record):
        if row == "another engine's":  # the other engine's save lands between this one's check and put
            SqliteMetaStore.put(metastore, record)
        raise StoreError("redis metastore put: ConnectionError")

    def get(variant_id):
        gets.append(variant_id)
        if len(gets) > 1 and row == "unknown":
            raise StoreError("redis metastore get: ConnectionError")
        return real_get(variant_id)

    metastore.put, metastore.get = put, get
    store.put(save.store_key, save.entry)  # K/V there, no row yet: the writer goes on to write both
    report = writer.write(save)
    assert report.failures == 1 and len(gets) == 2
    assert store.contains(save.store_key) == (row != "none")

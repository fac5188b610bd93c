"""The question probe reads only what it needs before selection: anchors and critical-layer keys.

An instrumented store logs every read; a marker in the log shows where the selection happened. Before
it, with anchors stored offline, QCFuse may read each chunk's metadata, the system chunk's rows and the
other chunks' anchor rows (K and V) of the layers the probe runs below the deepest critical layer,
and every row's keys (no values) at the critical layers: nothing else. The pass after it fetches every
layer, and the result equals the same request over whole entries read first. Negative control: a chunk
with no stored anchors makes the probe read every layer's keys (key-norm anchors derived at load),
and the check catches it. A question-only probe (QCLast) reads no retrieved chunk's rows below its
score layer.
"""

from __future__ import annotations

import pytest
import torch

from cachefuse.config import CacheFuseConfig
from cachefuse.offline.anchors import anchor_annotator
from cachefuse.select.qcfuse import anchors_from_meta
from cachefuse.select.registry import make_selector
from tests.helpers.fusion import make_case, make_engine


class LoggingStore:
    """A store that logs each read: ("meta", key) / ("rows", key, layer, rows or None, values) /
    ("layer", key, layer) / ("get", key)."""

    def __init__(self, inner, log: list) -> None:
        self.inner, self.log = inner, log

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, key):
        self.log.append(("get", key))
        return self.inner.get(key)

    def get_layer(self, key, layer):
        self.log.append(("layer", key, layer))
        entry = self.inner.get(key)
        return None if entry is None else (entry.k_nope[layer], entry.v[layer])

    def get_rows(self, key, layer, rows=None, values=True):
        self.log.append(("rows", key, layer, None if rows is None else tuple(rows.tolist()), values))
        return self.inner.get_rows(key, layer, rows, values)

    def get_meta(self, key):
        self.log.append(("meta", key))
        return self.inner.get_meta(key)


class MarkedSelector:
    """Wraps a selector: appends "SELECT" to the log when it selects."""

    def __init__(self, inner, log: list) -> None:
        self.inner, self.log = inner, log

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def initial_rows(self, ctx):
        self.log.append("SELECT")
        return self.inner.initial_rows(ctx)


pytestmark = pytest.mark.tiny_model("llama", num_layers=6)


CONFIG = CacheFuseConfig(qcfuse_critical_layers=(2, 3))


def _setup(adapter, with_anchors: bool):
    engine = make_engine(adapter, CONFIG)
    case = make_case(adapter.shape.vocab_size, seed=4, lengths=(10, 40, 30, 50, 8))
    engine.precompute([case.system])
    annotate = (anchor_annotator(adapter, case.system, "key_norm", CONFIG.qcfuse_anchor_ratio,
                                 CONFIG.qcfuse_sink_tokens) if with_anchors
                else lambda chunk_ids, entry: entry)  # stored as computed, without the default anchors
    engine.precompute(case.pieces, prefix_ids=case.system, annotate=annotate)
    return engine, case


def _run(engine, case, depth):
    log: list = []
    inner = engine.store
    engine.store = LoggingStore(inner, log)
    try:
        selector = MarkedSelector(make_selector("qcfuse", CONFIG), log)
        result, stats = engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.2,
                                       save_holes=False, preload_depth=depth)
    finally:
        engine.store = inner
    return result, stats, log


def _reads_beyond_the_probe(engine, case, log):
    """Reads before "SELECT" that are neither metadata, view rows below the deepest critical layer, nor
    keys of a critical layer."""
    keys = {engine.key(case.system, at_prompt_start=True): None}
    for piece in case.pieces:
        key = engine.key(piece)
        meta = engine.store.get_meta(key)
        anchors = anchors_from_meta(meta, len(piece), CONFIG.qcfuse_anchor_ratio, CONFIG.qcfuse_sink_tokens)
        keys[key] = None if anchors is None else tuple(anchors.tolist())
    deepest, critical = max(CONFIG.qcfuse_critical_layers), set(CONFIG.qcfuse_critical_layers)
    extra = []
    for read in log[:log.index("SELECT")]:
        kind, key = read[0], read[1]
        if kind == "meta":
            continue
        if kind == "rows":
            _, _, layer, rows, values = read
            if values and layer < deepest and rows == keys[key]:
                continue  # the view: the system chunk whole, other chunks' anchors
            if not values and rows is None and layer in critical:
                continue  # every row's keys at a critical layer
        extra.append(read)
    return extra


def test_probe_reads_only_anchors_and_critical_keys_before_selection(adapter):
    engine, case = _setup(adapter, with_anchors=True)
    result, stats, log = _run(engine, case, depth=2)
    assert "SELECT" in log and _reads_beyond_the_probe(engine, case, log) == []
    probe_reads = log[:log.index("SELECT")]
    assert any(r[0] == "rows" and not r[4] for r in probe_reads)  # the critical layers' keys were read
    assert all(r[0] == "layer" for r in log[log.index("SELECT") + 1:])  # then the pass fetches layers
    whole, _, whole_log = _run(engine, case, depth=0)  # whole entries first: the same result
    assert whole_log[0][0] == "get" and whole_log.index("SELECT") > 3
    assert torch.equal(result.logits, whole.logits)
    for k_a, k_b in zip(result.k, whole.k, strict=True):
        assert torch.equal(k_a, k_b)
    assert stats.chunks_hit == 4 and stats.probe_layers == max(CONFIG.qcfuse_critical_layers) + 1


def test_negative_control_chunks_without_anchors_read_every_layers_keys(adapter):
    engine, case = _setup(adapter, with_anchors=False)
    _, _, log = _run(engine, case, depth=2)
    extra = _reads_beyond_the_probe(engine, case, log)
    key_layers = {r[2] for r in extra if r[0] == "rows" and not r[4]}  # keys read outside the critical layers
    assert key_layers == set(range(adapter.shape.num_layers)) - set(CONFIG.qcfuse_critical_layers)


@pytest.mark.parametrize("tier", ["memory", "disk", "tiered"])
def test_partial_reads_equal_slices_of_the_whole_entry(adapter, tmp_path, tier):
    from cachefuse.store.base import StoreIdentity
    from cachefuse.store.disk import DiskStore
    from cachefuse.store.memory import MemoryStore
    from cachefuse.store.tiered import TieredStore

    engine, case = _setup(adapter, with_anchors=True)
    key = engine.key(case.pieces[1])
    entry = engine.store.get(key)
    identity = StoreIdentity("test-model", adapter.shape.num_layers, adapter.shape.dtype)
    disk = DiskStore(tmp_path, identity, capacity_bytes=1 << 30)
    store = {"memory": lambda: MemoryStore(identity, 1 << 30), "disk": lambda: disk,
             "tiered": lambda: TieredStore([MemoryStore(identity, 0), disk])}[tier]()
    store.put(key, entry)
    rows = torch.tensor([0, 3, 7])
    k, v = store.get_rows(key, 2, rows)
    assert torch.equal(k, entry.k_nope[2][rows]) and torch.equal(v, entry.v[2][rows])
    k_only, none = store.get_rows(key, 4, None, values=False)
    assert none is None and torch.equal(k_only, entry.k_nope[4])
    assert store.get_meta(key) == entry.meta
    assert store.get_rows("absent-key", 0) is None and store.get_meta("absent-key") is None


class FailingRowsStore(LoggingStore):
    """Partial reads of one key miss (the entry turned unreadable after planning)."""

    def __init__(self, inner, log, failing_key):
        super().__init__(inner, log)
        self.failing_key = failing_key

    def get_rows(self, key, layer, rows=None, values=True):
        if key == self.failing_key:
            self.inner.stats.record_miss("corrupt")
            return None
        return super().get_rows(key, layer, rows, values)


def test_a_probe_read_that_misses_reruns_with_that_chunk_as_a_hole(adapter):
    engine, case = _setup(adapter, with_anchors=True)
    failing = engine.key(case.pieces[1])
    selector = make_selector("qcfuse", CONFIG)
    inner = engine.store
    engine.store = FailingRowsStore(inner, [], failing)
    try:
        result, stats = engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.2,
                                       save_holes=False, preload_depth=2)
    finally:
        engine.store = inner
    assert stats.miss_reasons == {"corrupt": 1} and stats.chunks_hit == 3
    entry = inner.get(failing)
    inner.remove(failing)  # the same request with that chunk never stored
    expected, _ = engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.2, save_holes=False,
                                 preload_depth=0)
    inner.put(failing, entry)
    assert torch.equal(result.logits, expected.logits)


def test_question_only_probe_reads_no_retrieved_row_before_its_score_layer(adapter):
    """QCLast (a context-free probe, scored at the last layer) reads, before selecting, the system chunk's
    rows and every chunk's keys at the last layer, nothing of a retrieved chunk below it; QCFuse's anchor
    view reads the anchor rows of those chunks (negative control)."""
    engine, case = _setup(adapter, with_anchors=True)
    system_key = engine.key(case.system, at_prompt_start=True)
    last = adapter.shape.num_layers - 1

    def chunk_rows_before_selection(config):
        log: list = []
        inner, engine.store = engine.store, LoggingStore(engine.store, log)
        try:
            selector = MarkedSelector(make_selector("qcfuse", config), log)
            engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.2, save_holes=False,
                           preload_depth=2)
        finally:
            engine.store = inner
        return [r for r in log[:log.index("SELECT")] if r[0] != "meta" and r[1] != system_key]

    qclast = chunk_rows_before_selection(CONFIG.replace(qcfuse_view="question_only", qcfuse_layers="last"))
    assert qclast and all(r[0] == "rows" and r[2] == last and r[3] is None and not r[4] for r in qclast)
    anchored = chunk_rows_before_selection(CONFIG.replace(qcfuse_layers="last"))
    assert any(r[0] == "rows" and r[2] < last and r[4] for r in anchored)

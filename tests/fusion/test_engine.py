"""FusionEngine's own contract (cachefuse/fusion/engine.py), on the tiny llama model in float32.

- precompute stores one base entry per chunk under chunk_key (content, not position or prefix) and
  stores nothing for a chunk already there;
- with every chunk stored, every chunk hits and tokens_reused + tokens_recomputed is the prompt length;
  ratio 1.0 and full_prefill give the model's own logits, full_reuse does not (negative control);
- a declared chunk with no entry is a hole: reported missed ("not_stored"), saved under its variant's
  store key, and hit by the next prefill; save_holes=False saves nothing;
- a corrupt, truncated or foreign disk entry is a hole, with the output of a store without it, and saved;
  a stored entry of the wrong length is a hole too (serial and pipelined loading); nothing raises;
- neither the serial nor the pipelined pass writes into stored tensors; stats.to_dict() is JSON;
  blend_time_s is the injected clock's; a `choices` list of the wrong length is refused.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from cachefuse import ops
from cachefuse.chunks import KeyContext, chunk_key, segment_prompt
from cachefuse.config import CacheFuseConfig
from cachefuse.fusion.engine import FusionEngine, RankGroup
from cachefuse.fusion.plan import FusePlan
from cachefuse.metadata.base import variant_store_key
from cachefuse.store.base import StoreIdentity
from cachefuse.store.disk import DiskStore
from cachefuse.store.entry_format import encode_entry
from tests.helpers.fusion import make_case, make_engine, precompute_case
from tests.store.test_disk import _flip_data_byte, _truncate

LOGIT_TOL = dict(atol=1e-4, rtol=1e-4)
SEED = 11


@pytest.fixture(scope="module")
def case(adapter):
    return make_case(adapter.shape.vocab_size, seed=SEED)  # chunks: system, A, B, C; then the question


def _full(adapter, case, config: CacheFuseConfig | None = None) -> FusionEngine:
    engine = make_engine(adapter, config)
    precompute_case(engine, case, with_hole=False)
    return engine


def _on_ranks(source: FusionEngine, config: CacheFuseConfig, ranks: RankGroup) -> FusionEngine:
    """An engine over `source`'s store and metadata, as one rank of a tensor-parallel group."""
    return FusionEngine(source.adapter, source.store, source.key_context, config, metastore=source.metastore,
                        ranks=ranks)


def _copy(source: FusionEngine, target: FusionEngine, skip: str = "") -> FusionEngine:
    """`target` with every entry of `source`'s store but `skip` (keys only: no metadata rows)."""
    for key in source.store.keys():
        if key != skip:
            assert target.store.put(key, source.store.get(key))
    return target


def _tensors(engine: FusionEngine, key: str) -> list[torch.Tensor]:
    entry = engine.store.get(key)
    return [*entry.k_nope, *entry.v]


def test_precompute_stores_one_entry_per_chunk_under_its_content_key(adapter, case):
    engine = make_engine(adapter)
    keys = engine.precompute([case.system]) + engine.precompute(case.pieces, prefix_ids=case.system)
    chunks = [case.system, *case.pieces]
    starts = [True, False, False, False]  # the system chunk is keyed as computed at the prompt's start
    assert keys == [chunk_key(ids, engine.key_context, at_prompt_start=s)
                    for ids, s in zip(chunks, starts, strict=True)]
    assert keys == [engine.key(ids, at_prompt_start=s) for ids, s in zip(chunks, starts, strict=True)]
    assert sorted(engine.store.keys()) == sorted(keys) and len(set(keys)) == 4
    for key, ids in zip(keys, chunks, strict=True):
        entry = engine.store.get(key)
        assert (entry.num_tokens, entry.num_layers) == (len(ids), adapter.shape.num_layers)
        assert [r.prefix for r in engine.metastore.variants(key)] == [()]  # the base variant
    # computed after the prefix, not alone
    expected = engine.compute_chunk(case.pieces[0], case.system)
    assert all(torch.equal(a, b) for a, b in zip(_tensors(engine, keys[1]), [*expected.k_nope, *expected.v],
                                                 strict=True))
    alone = engine.compute_chunk(case.pieces[0])
    assert not torch.equal(alone.k_nope[-1], expected.k_nope[-1])

    # Same content, another prefix: same key, nothing stored or recomputed; the stored bytes stay.
    puts, before = engine.store.stats.puts, _tensors(engine, keys[1])
    assert engine.precompute(case.pieces[::-1], prefix_ids=case.question) == keys[:0:-1]
    assert engine.store.stats.puts == puts and engine.metastore.count() == 4
    assert all(a is b for a, b in zip(_tensors(engine, keys[1]), before, strict=True))
    # another key context (config hash) gives other keys
    other = KeyContext("test-model", "float32", config_hash="other")
    assert chunk_key(case.pieces[0], other) != keys[1]


def test_all_chunks_stored_every_chunk_hits_and_token_counts_add_up(adapter, case):
    engine = _full(adapter, case)
    keys = list(engine.store.keys())
    result, stats = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=0.15)
    n = len(case.token_ids)
    assert (stats.chunks_hit, stats.chunks_missed, stats.miss_reasons) == (4, 0, {})
    assert stats.holes_saved == 0 and stats.saved_keys == () and result.hole_segments == []
    assert stats.tokens_recomputed == stats.layer_rows[-1] < n and stats.tokens_reused > 0
    assert stats.tokens_reused + stats.tokens_recomputed == n
    assert len(stats.layer_rows) == len(stats.layer_seconds) == adapter.shape.num_layers
    assert stats.bytes_loaded == sum(engine.store.get(k).nbytes for k in keys)
    assert stats.load_bytes_by_tier == {"memory": stats.bytes_loaded}
    assert stats.chunk_cfo == [0.0, 0.0, 0.5, 0.5]  # B and C: base variants after a non-empty prefix
    assert engine.store.keys() == keys

    _, full = engine.prefill(case.token_ids, case.chunks, selector="full_prefill")
    assert (full.tokens_reused, full.tokens_recomputed, full.chunks_hit) == (0, n, 4)


def test_ratio_one_and_full_prefill_equal_the_model_and_full_reuse_differs(adapter, case):
    engine = _full(adapter, case)
    with torch.inference_mode():
        expected = adapter.model(torch.tensor([case.token_ids])).logits[0, -1].float()
    ratio_one, _ = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=1.0)
    full, _ = engine.prefill(case.token_ids, case.chunks, selector="full_prefill")
    torch.testing.assert_close(ratio_one.logits, expected, **LOGIT_TOL)
    torch.testing.assert_close(full.logits, expected, **LOGIT_TOL)
    reuse, stats = engine.prefill(case.token_ids, case.chunks, selector="full_reuse")
    assert stats.chunks_hit == 4 and (reuse.logits - expected).abs().max() > 100 * LOGIT_TOL["atol"]


@pytest.mark.parametrize("hole", [0, 1], ids=["first-chunk", "after-a-prefix"])
def test_missing_chunk_is_a_hole_saved_under_its_variant_key_and_hit_next_time(adapter, case, hole):
    engine = make_engine(adapter)
    engine.precompute([case.system])
    engine.precompute([p for i, p in enumerate(case.pieces) if i != hole], prefix_ids=case.system)
    stored = set(engine.store.keys())
    result, stats = engine.prefill(case.token_ids, case.chunks)
    keys = [engine.key(p) for p in case.pieces]
    saved = variant_store_key(keys[hole], tuple(keys[:hole]))  # the declared non-system chunks before it
    assert (stats.chunks_hit, stats.chunks_missed, stats.miss_reasons) == (3, 1, {"not_stored": 1})
    assert result.hole_segments == [hole + 1] and stats.chunk_cfo[hole + 1] is None
    assert stats.holes_saved == 1 and stats.saved_keys == (saved,) and stats.save_failures == 0
    assert set(engine.store.keys()) == stored | {saved} and (saved == keys[0]) == (hole == 0)
    assert [r.store_key for r in stats.saved_variants] == [saved]
    assert engine.store.get(saved).num_tokens == len(case.pieces[hole])

    _, again = engine.prefill(case.token_ids, case.chunks)
    assert (again.chunks_hit, again.chunks_missed, again.holes_saved) == (4, 0, 0)
    assert again.chunk_cfo[hole + 1] == 0.0  # the saved variant matches its prefix exactly
    # what was read, by store key (tier placement counts these): the variant's key, not its chunk's
    assert saved not in stats.loaded_keys and saved in again.loaded_keys and len(again.loaded_keys) == 4
    assert (keys[hole] in again.loaded_keys) == (hole == 0)


def test_save_holes_false_saves_nothing(adapter, case):
    engine = make_engine(adapter)
    precompute_case(engine, case)  # B a hole
    keys, puts, rows = engine.store.keys(), engine.store.stats.puts, engine.metastore.count()
    for _ in range(2):
        _, stats = engine.prefill(case.token_ids, case.chunks, save_holes=False)
        assert (stats.chunks_missed, stats.holes_saved) == (1, 0)
        assert stats.saved_keys == () and stats.saved_variants == ()
    assert engine.store.keys() == keys and engine.store.stats.puts == puts
    assert engine.metastore.count() == rows


@pytest.mark.parametrize("damage, reason", [(_flip_data_byte, "corrupt"), (_truncate, "truncated"),
                                            ("foreign", "foreign_model")],
                         ids=["flipped", "truncated", "foreign"])
def test_damaged_disk_entry_is_a_hole_with_the_output_of_a_missing_one(adapter, case, tmp_path, damage,
                                                                       reason):
    source = _full(adapter, case)
    identity = StoreIdentity("test-model", adapter.shape.num_layers, adapter.shape.dtype)
    disk = FusionEngine(adapter, DiskStore(tmp_path, identity, 1 << 30), source.key_context,
                        CacheFuseConfig())
    engine = _copy(source, disk)
    key_a = engine.key(case.pieces[0])
    without_a = _copy(source, make_engine(adapter), skip=key_a)
    path = tmp_path / key_a[:2] / f"{key_a}.safetensors"
    if damage == "foreign":
        foreign = StoreIdentity("other-model", adapter.shape.num_layers, torch.float32)
        path.write_bytes(encode_entry(source.store.get(key_a), foreign))
    else:
        damage(path)

    result, stats = engine.prefill(case.token_ids, case.chunks)
    expected, expected_stats = without_a.prefill(case.token_ids, case.chunks, save_holes=False)
    assert torch.equal(result.logits, expected.logits)
    assert all(torch.equal(a, b) for a, b in zip(result.k + result.v, expected.k + expected.v, strict=True))
    assert stats.miss_reasons == {reason: 1} and expected_stats.miss_reasons == {"not_stored": 1}
    assert (stats.chunks_hit, stats.chunks_missed) == (3, 1) and result.hole_segments == [1]
    assert stats.saved_keys == (key_a,)  # saved again in place of the bad file
    _, again = engine.prefill(case.token_ids, case.chunks)
    assert (again.chunks_hit, again.miss_reasons) == (4, {})


def test_wrong_length_entry_is_a_hole_with_the_output_of_a_missing_one(adapter, case):
    engine = _full(adapter, case)
    key_a = engine.key(case.pieces[0])
    without_a = _copy(engine, make_engine(adapter), skip=key_a)
    engine.store.put(key_a, engine.compute_chunk(case.pieces[1], case.system))  # B's 19 tokens under A's key
    expected, _ = without_a.prefill(case.token_ids, case.chunks, save_holes=False)
    for depth in (0, 2):  # serial: checked on load; pipelined: a mid-pass miss, the pass re-run
        engine.store.put(key_a, engine.compute_chunk(case.pieces[1], case.system))  # B's 19 tokens under A's key
        result, stats = engine.prefill(case.token_ids, case.chunks, preload_depth=depth)
        assert stats.miss_reasons == {"length_mismatch": 1} and result.hole_segments == [1]
        assert stats.chunks_hit == 3 and torch.equal(result.logits, expected.logits)
        assert stats.holes_saved == 1 and engine.store.get(key_a).num_tokens == len(case.pieces[0])  # replaced
        _, again = engine.prefill(case.token_ids, case.chunks, preload_depth=depth, save_holes=False)
        assert again.chunks_hit == 4 and again.miss_reasons == {}  # the next request hits it


@pytest.mark.parametrize("depth", [0, 2])
def test_stored_tensors_unchanged_by_prefill(adapter, case, depth):
    engine = _full(adapter, case, CacheFuseConfig(preload_depth=depth))
    before = {key: [t.clone() for t in _tensors(engine, key)] for key in engine.store.keys()}
    for selector in ("cacheblend", "full_reuse"):
        engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.3)
    for key, tensors in before.items():
        assert all(torch.equal(a, b) for a, b in zip(_tensors(engine, key), tensors, strict=True))


def test_stats_to_dict_is_json_and_blend_time_comes_from_the_clock(adapter, case):
    ticks = []

    def clock() -> float:
        ticks.append(float(len(ticks)))
        return ticks[-1]

    store = make_engine(adapter).store
    engine = FusionEngine(adapter, store, KeyContext("test-model", "float32"),
                          CacheFuseConfig(collect_attention_stats=True, load_timeout_s=None),  # a tick per call
                          clock=clock)
    precompute_case(engine, case)
    ticks.clear()
    _, stats = engine.prefill(case.token_ids, case.chunks)
    assert 0 < stats.blend_time_s <= ticks[-1] - ticks[0] and stats.blend_time_s.is_integer()  # clock ticks
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["saved_keys"] == list(stats.saved_keys) and len(data["saved_variants"]) == 1
    assert data["miss_reasons"] == {"not_stored": 1} and data["chunks_hit"] == 3


def test_choices_of_the_wrong_length_are_refused(adapter, case):
    engine = make_engine(adapter)
    with pytest.raises(ValueError, match="3 variant choices for 4 declared chunks"):
        engine.prefill(case.token_ids, case.chunks, variants=[None] * 3)


def test_a_chunk_saved_after_other_tokens_is_never_served_as_an_exact_system_chunk(adapter, case):
    """One request's hole must not become another request's system chunk: the system chunk (offset 0)
    is reused with no row recomputed, so only an entry computed at the prompt's start may serve it."""
    engine = make_engine(adapter)
    doc, glue = case.pieces[0], case.question
    # Tenant 1: the document after undeclared tokens, no declared chunk before it: saved with prefix ().
    first = glue + doc + case.pieces[1]
    engine.prefill(first, [[len(glue), len(glue) + len(doc)]], selector="full_reuse")
    (saved,) = engine.store.keys()
    assert saved == engine.key(doc) != engine.key(doc, at_prompt_start=True)
    # Tenant 2: the same text as its system chunk, nothing recomputed after the (zero) full layers.
    second = doc + case.pieces[2] + case.question
    result, stats = engine.prefill(second, [[0, len(doc)]], selector="full_reuse", save_holes=False)
    assert stats.chunks_hit == 0 and stats.miss_reasons == {"not_stored": 1}
    exact, _ = engine.prefill(second, [], selector="full_prefill", save_holes=False)
    positions = torch.arange(len(doc))
    for layer in range(adapter.shape.num_layers):
        torch.testing.assert_close(result.k[layer][:len(doc)], exact.k[layer][:len(doc)], atol=1e-5, rtol=1e-5)
    # Negative control: the entry tenant 1 saved is not the exact one, so serving it would change the answer.
    stored = engine.store.get(saved).k_nope[-1]
    exact_k_nope = ops.strip_rope(exact.k[-1][:len(doc)], positions, adapter.rope_spec)
    assert (stored - exact_k_nope).abs().max() > 1e-3


def test_tensor_parallel_ranks_agree_on_hits_before_the_pass(adapter, case):
    """Under tensor parallelism a chunk is loaded only where every rank loaded it: a rank that sees a hit
    another rank missed computes it as a hole too (else the ranks recompute different rows and the model's
    collectives deadlock). The agreement is the pass's first RankSum op: the sum of the ranks' hit flags,
    here the other rank's missing chunk B (a rank whose pass fails instead is the PassBatch's agreement:
    tests/fusion/test_batch.py)."""
    sums = []

    def other_rank_missed_b(values):  # an all-reduce over this rank and one that hits all but B
        sums.append(values.clone())
        other = values.clone()
        if len(sums) == 1:  # the hit flags, per declared chunk
            other[2] = 0.0
        return values + other  # later: the score sums, the other rank's heads scoring alike

    config = CacheFuseConfig(preload_depth=2)  # agreement forces serial loading
    engine = _on_ranks(_full(adapter, case, config), config, RankGroup(size=2, sum_over_ranks=other_rank_missed_b))
    result, stats = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", save_holes=False)
    assert sums[0].tolist() == [1.0, 1.0, 1.0, 1.0]
    assert len(sums) == 2  # the hits, then the check layer's scores: nothing else crosses the ranks
    assert stats.chunks_hit == 3 and stats.miss_reasons == {"other_rank_missed": 1}
    hole = make_engine(adapter)  # the same prompt where B was never stored, on one rank
    precompute_case(hole, case, with_hole=True)
    expected, _ = hole.prefill(case.token_ids, case.chunks, selector="cacheblend", save_holes=False)
    torch.testing.assert_close(result.logits, expected.logits, **LOGIT_TOL)
    # Negative control: with every rank hitting B, B is loaded and the answer is the full store's
    sums.clear()
    engine = _on_ranks(engine, config, RankGroup(size=2, sum_over_ranks=lambda values: 2 * values))
    loaded, stats = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", save_holes=False)
    assert stats.chunks_hit == 4 and not stats.miss_reasons
    assert (loaded.logits - expected.logits).abs().max() > 1e-4


def test_a_failing_metadata_store_costs_one_call_per_request(adapter, case):
    """A stalled Redis or a meta.sqlite locked by another process costs its timeout per call: the request
    pins all its variants in one call, after its failure records no uses, and is fused all the same."""
    from cachefuse.errors import StoreError

    engine = _full(adapter, case)
    healthy, _ = engine.prefill(case.token_ids, case.chunks, save_holes=False)
    calls = []

    def failing(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise StoreError("metadata store: timed out")
        return call

    engine.metastore.pin = failing("pin")
    engine.metastore.pin_many = failing("pin_many")
    engine.metastore.record_uses = failing("record_uses")
    result, stats = engine.prefill(case.token_ids, case.chunks, save_holes=False)
    assert calls == ["pin_many"] and stats.chunks_hit == 4  # four chunks with metadata rows, one call
    assert torch.equal(result.logits, healthy.logits)


class _SlowStore:
    """A store whose every call takes `seconds` on the engine's clock (a Redis answering each call just
    inside its timeout, a cold network disk): existence checks, whole and per-layer reads, the probe's."""

    SLOW = ("contains", "get", "get_layer", "get_rows", "get_meta")

    def __init__(self, inner, clock: list[float], seconds: float) -> None:
        self.inner, self.now, self.seconds = inner, clock, seconds

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in self.SLOW:
            return attr

        def slow(*args, **kwargs):
            self.now[0] += self.seconds
            return attr(*args, **kwargs)
        return slow


@pytest.mark.parametrize(("selector", "depth"), [("cacheblend", 0), ("cacheblend", 2), ("fusionrag", 2)])
def test_a_slow_store_costs_a_blend_at_most_its_load_timeout(adapter, case, selector, depth):
    """Every call to this store takes 3 s: past `load_timeout_s` (5 s) the blend starts no read (existence
    checks and the question probe's reads included) and computes the rest in full (miss reason
    "load_timeout"), so one request cannot hold the step for as many calls as it makes. The answer is that
    of a store holding only what was read in time."""
    now = [0.0]
    engine = _full(adapter, case, CacheFuseConfig(preload_depth=depth, load_timeout_s=5.0))
    engine.clock = lambda: now[0]
    engine.store = _SlowStore(engine.store, now, 3.0)
    result, stats = engine.prefill(case.token_ids, case.chunks, selector=selector, save_holes=False)
    assert stats.miss_reasons.get("load_timeout", 0) >= 2 and stats.chunks_hit <= 2, stats.miss_reasons
    assert stats.blend_time_s <= 5.0 + 3.0  # the deadline and the one call begun before it
    without = make_engine(adapter, CacheFuseConfig(preload_depth=0, load_timeout_s=None))
    for key in stats.loaded_keys:  # a store holding only what the slow blend read in time
        assert without.store.put(key, engine.store.inner.get(key))
    expected, _ = without.prefill(case.token_ids, case.chunks, selector=selector, save_holes=False)
    torch.testing.assert_close(result.logits, expected.logits, rtol=0, atol=1e-5)

    now[0] = 0.0  # control: no bound, every chunk read however long it takes
    engine.config = CacheFuseConfig(preload_depth=depth, load_timeout_s=None)
    _, unbounded = engine.prefill(case.token_ids, case.chunks, selector=selector, save_holes=False)
    assert unbounded.chunks_hit == len(case.chunks) and not unbounded.miss_reasons


@pytest.mark.parametrize("depth", [0, 2])
def test_compute_time_never_counts_against_the_load_timeout(adapter, case, depth):
    """load_timeout_s bounds the time spent in store calls, not the blend: on a slow machine (here the
    clock jumps 100 s while the pass computes) a pipelined blend, whose reads run beside the compute,
    found its deadline passed at the next layer and recomputed every chunk in full."""
    now = [0.0]
    engine = _full(adapter, case, CacheFuseConfig(preload_depth=depth, load_timeout_s=5.0))
    engine.clock = lambda: now[0]
    real_steps = engine.fusor.fuse_steps

    def slow_steps(request, selector):
        now[0] += 100.0  # the pass's compute, on a slow machine
        return (yield from real_steps(request, selector))

    engine.fusor.fuse_steps = slow_steps
    _, stats = engine.prefill(case.token_ids, case.chunks, save_holes=False)
    assert stats.chunks_hit == len(case.chunks) and not stats.miss_reasons, stats.miss_reasons
    assert stats.blend_time_s >= 100.0


def test_a_plan_with_its_callers_chunk_keys_is_not_hashed_again(adapter, case):
    """The vLLM scheduler hashes each chunk's key once and sends it in the plan: the engine loads under those
    keys (the control: keys of other chunks find nothing, so every chunk is a hole)."""
    engine = _full(adapter, case)
    segments = segment_prompt(len(case.token_ids), case.chunks)
    keys = [engine.meta_key(case.token_ids[s.start:s.end], at_prompt_start=s.is_system) for s in segments if s.is_chunk]
    plan = FusePlan(token_ids=case.token_ids, segments=segments, selector="cacheblend", ratio=0.15, meta_keys=keys,
                    save_holes=False)
    expected, expected_stats = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=0.15,
                                              save_holes=False)
    result, stats = engine.fuse(plan)
    assert stats.chunks_hit == expected_stats.chunks_hit == len(keys)
    torch.testing.assert_close(result.logits, expected.logits, rtol=0, atol=0)
    _, foreign = engine.fuse(dataclasses.replace(plan, meta_keys=[key[::-1] for key in keys]))
    assert foreign.chunks_hit == 0 and foreign.miss_reasons == {"not_stored": len(keys)}


def _on_sqlite_file(adapter, case, path, config: CacheFuseConfig):
    """An engine whose metadata is a meta.sqlite file (waits counted on a clock only sleeping advances), with
    the system, A and C stored and B a hole."""
    from cachefuse.metadata.sqlite import SqliteMetaStore
    from tests.metadata.test_sqlite import WaitClock

    clock = WaitClock()
    plain = make_engine(adapter, config)
    metastore = SqliteMetaStore(str(path), max_variants=100, wait_clock=clock, sleep=clock.sleep)
    engine = FusionEngine(adapter, plain.store, plain.key_context, config, metastore=metastore)
    precompute_case(engine, case, with_hole=True)
    return engine, clock


@pytest.mark.parametrize("wait_s", [0.05, 0.5])
def test_a_metadata_file_locked_by_another_process_costs_a_request_its_wait_budget(adapter, case, tmp_path,
                                                                                    wait_s):
    """Another connection holds meta.sqlite in BEGIN EXCLUSIVE. The request (variants planned before, as the
    vLLM scheduler does) pins, then saves its hole inline: those calls wait `metadata_wait_s` in all, not
    SQLite's 2 s each. The request is fused all the same (its entries read whole, nothing pinned, no reuse
    recorded) with the answer of a healthy store; the hole's row is refused and its K/V kept (the row may
    exist for all this engine knows). Control: a budget of 0.5 s waits 0.5 s (the figure follows the
    budget, so a wait per call would show), and with the file free the same request waits not at all."""
    import sqlite3

    config = CacheFuseConfig(metadata_wait_s=wait_s)
    engine, clock = _on_sqlite_file(adapter, case, tmp_path / "meta.sqlite", config)
    variants = engine.plan_variants(case.token_ids, case.chunks)
    healthy, _ = engine.prefill(case.token_ids, case.chunks, variants=variants, save_holes=False)
    assert clock.sleeps == [] and len(engine.store.keys()) == 3
    holder = sqlite3.connect(str(tmp_path / "meta.sqlite"), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        result, stats = engine.prefill(case.token_ids, case.chunks, variants=variants, save_holes=True)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert sum(clock.sleeps) == pytest.approx(wait_s)
    assert engine.metastore.busy_refusals == 3  # pin_many; the hole's row and the check whether it exists
    assert stats.chunks_hit == 3 and stats.save_failures == 1 and not stats.saved_keys
    torch.testing.assert_close(result.logits, healthy.logits, rtol=0, atol=0)
    assert len(engine.store.keys()) == 4  # system, A, C, and B's K/V under its variant's key
    assert all(engine.metastore.pin_count(v.variant_id) == 0 for v in variants if v is not None)

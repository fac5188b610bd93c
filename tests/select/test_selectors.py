"""Selector sets: sizes follow the ratio (and schedule), gradual-filtering sets nest, EPIC picks chunk
heads, the control is seeded. Forced rows are the fusor's job: see tests/fusion/test_fusor.py."""

import dataclasses
import math

import pytest
import torch

from cachefuse.chunks import Segment
from cachefuse.config import CacheFuseConfig
from cachefuse.select.base import (
    CheckLayerKV,
    PlannedChunk,
    RowEstimate,
    SelectionContext,
    num_rows_for_ratio,
)
from cachefuse.select.cacheblend import kv_deviation
from cachefuse.select.registry import make_selector

SEGMENTS = (
    Segment(0, 10, is_chunk=True, is_system=True),
    Segment(10, 37, is_chunk=True, is_system=False),
    Segment(47, 50, is_chunk=True, is_system=False),
    Segment(97, 13, is_chunk=False, is_system=False),
)


def make_ctx(ratio: float) -> SelectionContext:
    candidates = [s for s in SEGMENTS if s.is_chunk and not s.is_system]
    rows = torch.cat([torch.arange(s.start, s.end) for s in candidates])
    return SelectionContext(num_tokens=110, num_layers=8, segments=SEGMENTS, candidate_rows=rows,
                            candidate_segments=tuple(candidates), ratio=ratio)


def check_kv(rows: torch.Tensor, seed: int) -> CheckLayerKV:
    g = torch.Generator().manual_seed(seed)
    shape = (rows.numel(), 2, 4)
    return CheckLayerKV(rows, torch.randn(shape, generator=g), torch.randn(shape, generator=g),
                        torch.randn(shape, generator=g), torch.randn(shape, generator=g))


@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.15, 0.3, 1.0])
def test_cacheblend_size_follows_ratio(ratio):
    ctx = make_ctx(ratio)
    selector = make_selector("cacheblend", CacheFuseConfig())
    assert selector.num_full_layers(8) == 2 and selector.check_layers(8) == (1,)
    chosen = selector.select_at_check(ctx, 0, check_kv(ctx.candidate_rows, 0))
    assert chosen.numel() == math.ceil(ratio * 87 - 1e-9)
    assert torch.equal(chosen, chosen.sort().values)
    assert set(chosen.tolist()) <= set(ctx.candidate_rows.tolist())


def test_cacheblend_picks_highest_deviation():
    ctx = make_ctx(0.1)
    kv = check_kv(ctx.candidate_rows, 1)
    selector = make_selector("cacheblend", CacheFuseConfig(cacheblend_deviation="k"))
    chosen = selector.select_at_check(ctx, 0, kv)
    deviation = kv_deviation(kv, "k")
    threshold = deviation.sort(descending=True).values[chosen.numel() - 1]
    chosen_dev = deviation[torch.searchsorted(ctx.candidate_rows, chosen)]
    assert (chosen_dev >= threshold).all()


def test_gradual_filtering_nests_and_follows_schedule():
    config = CacheFuseConfig(cacheblend_check_layers=(1, 3, 5), cacheblend_ratio_schedule=(1.6, 1.3, 1.0))
    selector = make_selector("cacheblend", config)
    ctx = make_ctx(0.2)
    rows = ctx.candidate_rows
    sizes = []
    for check_index in range(3):
        chosen = selector.select_at_check(ctx, check_index, check_kv(rows, check_index))
        assert set(chosen.tolist()) <= set(rows.tolist())  # nested
        sizes.append(chosen.numel())
        rows = chosen
    assert sizes == [num_rows_for_ratio(0.2 * m, 87) for m in (1.6, 1.3, 1.0)]
    assert sizes[0] > sizes[1] > sizes[2]


def test_cacheblend_sink_tokens_are_kept_within_the_budget():
    ctx = make_ctx(0.1)
    kv = check_kv(ctx.candidate_rows, 3)
    plain = make_selector("cacheblend", CacheFuseConfig()).select_at_check(ctx, 0, kv)
    sinks = make_selector("cacheblend", CacheFuseConfig(cacheblend_sink_tokens=2)).select_at_check(ctx, 0, kv)
    assert sinks.numel() == plain.numel() == math.ceil(0.1 * 87)  # the same budget
    assert {10, 11, 47, 48} <= set(sinks.tolist())  # each chunk's first two tokens
    assert not {10, 11, 47, 48} <= set(plain.tolist())  # control: deviation alone picks others
    rest = [r for r in sinks.tolist() if r not in (10, 11, 47, 48)]
    assert set(rest) <= set(plain.tolist())  # the remaining budget by deviation, as before
    with pytest.raises(ValueError, match="cacheblend_sink_tokens"):
        CacheFuseConfig(cacheblend_sink_tokens=-1)


@pytest.mark.parametrize("floor, chunk2_rows", [(1.0, 15), (0.5, 7)])
def test_cacheblend_chunk_floor_gives_each_chunk_its_share(floor, chunk2_rows):
    ctx = make_ctx(0.3)  # 27 of 87 rows: chunk 1 has 37 candidates, chunk 2 has 50
    kv = check_kv(ctx.candidate_rows, 4)
    in_chunk2 = ctx.candidate_rows >= 47
    fresh_v = torch.where(in_chunk2[:, None, None], kv.loaded_v + 1e-3 * kv.fresh_v, kv.fresh_v)
    kv = CheckLayerKV(kv.rows, kv.fresh_k_nope, fresh_v, kv.loaded_k_nope, kv.loaded_v)  # chunk 2 barely deviates
    plain = make_selector("cacheblend", CacheFuseConfig()).select_at_check(ctx, 0, kv)
    assert (plain < 47).all()  # control: one global ranking starves chunk 2
    config = CacheFuseConfig(cacheblend_chunk_floor=floor)
    chosen = make_selector("cacheblend", config).select_at_check(ctx, 0, kv)
    assert chosen.numel() == plain.numel() == 27  # the same budget
    assert int((chosen >= 47).sum()) == chunk2_rows  # floor(floor x 27 x 50/87) of its own best rows
    deviation = kv_deviation(kv, "v")[in_chunk2]
    best = ctx.candidate_rows[in_chunk2][deviation.topk(chunk2_rows).indices]
    assert set(best.tolist()) <= set(chosen.tolist())
    with pytest.raises(ValueError, match="cacheblend_chunk_floor"):
        CacheFuseConfig(cacheblend_chunk_floor=1.5)


@pytest.mark.parametrize("metric", ["k", "v", "kv"])
def test_deviation_zero_when_identical(metric):
    kv = check_kv(torch.arange(5), 2)
    same = CheckLayerKV(kv.rows, kv.loaded_k_nope, kv.loaded_v, kv.loaded_k_nope, kv.loaded_v)
    assert torch.count_nonzero(kv_deviation(same, metric)) == 0
    assert torch.count_nonzero(kv_deviation(kv, metric)) == 5


@pytest.mark.parametrize("metric", ["k", "v", "kv"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_damaged_row_is_recomputed_and_leaves_the_others_ranking_alone(metric, bad):
    """A non-finite fresh or loaded value (a damaged or overflowed entry) ranks its row first; the other
    rows keep the order they have without it. With `kv`, one infinite row had made the V mean infinite,
    every other row's V score 0 and the ranking arbitrary."""
    ctx = make_ctx(0.1)
    kv = check_kv(ctx.candidate_rows, 3)
    damaged = 7
    loaded_v, loaded_k = kv.loaded_v.clone(), kv.loaded_k_nope.clone()
    (loaded_v if metric != "k" else loaded_k)[damaged, 0, 0] = bad
    broken = CheckLayerKV(kv.rows, kv.fresh_k_nope, kv.fresh_v, loaded_k, loaded_v)
    selector = make_selector("cacheblend", CacheFuseConfig(cacheblend_deviation=metric))
    chosen = selector.select_at_check(ctx, 0, broken).tolist()
    assert int(kv.rows[damaged]) in chosen
    keep = torch.arange(kv.rows.numel()) != damaged
    others = kv_deviation(broken, metric)[keep]
    if metric == "kv":  # each part normalised by the mean of its finite rows: V's as if the damaged row were absent
        dev_k, dev_v = kv_deviation(broken, "k"), kv_deviation(broken, "v")
        expected = dev_k[keep] / dev_k.mean() + dev_v[keep] / dev_v[keep].mean()  # K is finite everywhere
    else:
        expected = kv_deviation(CheckLayerKV(*(t[keep] for t in (kv.rows, kv.fresh_k_nope, kv.fresh_v, loaded_k,
                                                                  loaded_v))), metric)
    torch.testing.assert_close(others, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("ratio", [0.05, 0.15, 0.5])
def test_epic_picks_first_tokens_of_each_chunk(ratio):
    ctx = make_ctx(ratio)
    chosen = make_selector("epic", CacheFuseConfig()).initial_rows(ctx).tolist()
    expected = [r for s in ctx.candidate_segments for r in range(s.start, s.start + math.ceil(ratio * s.length))]
    assert chosen == expected
    fixed = make_selector("epic", CacheFuseConfig(epic_k=3)).initial_rows(ctx).tolist()
    assert fixed == [10, 11, 12, 47, 48, 49]


def test_full_reuse_and_full_prefill():
    ctx = make_ctx(0.5)
    reuse = make_selector("full_reuse", CacheFuseConfig())
    assert reuse.num_full_layers(8) == 0 and reuse.initial_rows(ctx).numel() == 0
    assert make_selector("full_prefill", CacheFuseConfig()).num_full_layers(8) == 8


def test_estimated_rows_match_the_rows_picked():
    """Each selector's estimate before the pass (Selector.estimate_rows) against what it picks."""
    chunks = [PlannedChunk(s.length) for s in SEGMENTS if s.is_chunk and not s.is_system]
    ctx = make_ctx(0.3)
    for name, config in (("cacheblend", CacheFuseConfig()), ("random", CacheFuseConfig()),
                         ("epic", CacheFuseConfig(epic_k=3))):
        estimate = make_selector(name, config).estimate_rows(chunks, 8)
        rows = num_rows_for_ratio(0.3, estimate.num_ratio_candidates) + estimate.num_planned_rows
        if name == "cacheblend":
            assert estimate == RowEstimate(0, 87) and rows == num_rows_for_ratio(0.3, 87)  # kept after its check
        else:
            assert rows == make_selector(name, config).initial_rows(ctx).numel()
    assert make_selector("full_reuse", CacheFuseConfig()).estimate_rows(chunks, 8) == RowEstimate(0, 0)
    ratio_epic = make_selector("epic", CacheFuseConfig()).estimate_rows(chunks, 8)
    # ceil per chunk (12 + 15) can exceed ceil over all (27): at most one row per chunk
    assert 0 <= make_selector("epic", CacheFuseConfig()).initial_rows(ctx).numel() - num_rows_for_ratio(
        0.3, ratio_epic.num_ratio_candidates) <= len(chunks)


def test_random_is_seeded_and_sized():
    ctx = make_ctx(0.3)
    a = make_selector("random", CacheFuseConfig(random_seed=1)).initial_rows(ctx)
    b = make_selector("random", CacheFuseConfig(random_seed=1)).initial_rows(ctx)
    c = make_selector("random", CacheFuseConfig(random_seed=2)).initial_rows(ctx)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.numel() == math.ceil(0.3 * 87)


@pytest.mark.parametrize("name", ["fusionrag", "qcfuse"])
@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.55])
def test_query_aware_selectors_recompute_the_rows_the_probe_scores_highest(name, ratio):
    """The probe's scores decide: the ceil(r x n) candidates it scored highest, no others (picking the
    lowest passed every other test)."""
    ctx = make_ctx(ratio)
    scores = torch.randperm(ctx.candidate_rows.numel(), generator=torch.Generator().manual_seed(5)).float()
    ctx = dataclasses.replace(ctx, probe_scores=scores)
    count = num_rows_for_ratio(ratio, ctx.candidate_rows.numel())
    expected = ctx.candidate_rows[scores.argsort(descending=True)[:count]].sort().values
    rows = make_selector(name, CacheFuseConfig()).initial_rows(ctx)
    assert torch.equal(rows, expected)
    lowest = ctx.candidate_rows[scores.argsort()[:count]].sort().values
    assert not torch.equal(rows, lowest)  # control: the other end of the ranking is another set

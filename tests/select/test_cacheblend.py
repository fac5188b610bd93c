"""cacheblend (cachefuse/select/cacheblend.py): the set's size follows the ratio (and the gradual-filtering
schedule, whose sets nest), the highest KV deviation is picked, sink tokens and the per-chunk floor share
the budget, a damaged row is recomputed. Forced rows are the fusor's job: see tests/fusion/test_fusor.py."""

import math

import pytest
import torch

from cachefuse.config import CacheFuseConfig
from cachefuse.select.base import CheckLayerKV, SelectionContext, num_rows_for_ratio
from cachefuse.select.cacheblend import deviation_from_sums, kv_deviation
from cachefuse.select.registry import make_selector
from tests.helpers.selection import check_kv, make_ctx


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


@pytest.mark.parametrize("metric", ["k", "v", "kv"])
def test_the_rank_sum_is_one_reduction_per_check_layer(metric):
    """Under tensor parallelism each rank's partial deviations (`check_partials`, one tensor: K's and V's
    stacked for "kv") are summed over the ranks by the pass's one RankSum op, and `select_at_check` ranks
    by the sum. Two "ranks" holding one head each, summed, select as one rank holding both; a rank ranking
    by its own heads alone (the negative control) selects other rows."""
    kv = check_kv(torch.arange(12), 2)  # two KV heads
    kv = CheckLayerKV(kv.rows, kv.fresh_k_nope, kv.fresh_v, kv.loaded_k_nope,  # the heads deviate differently
                      kv.loaded_v + torch.linspace(0, 1, 12)[:, None, None] * torch.tensor([1.0, -3.0])[None, :, None])
    ranks = [CheckLayerKV(kv.rows, *(t[:, head:head + 1] for t in (kv.fresh_k_nope, kv.fresh_v, kv.loaded_k_nope,
                                                                     kv.loaded_v))) for head in (0, 1)]
    config = CacheFuseConfig(recompute_ratio=0.25, cacheblend_deviation=metric)
    selector = make_selector("cacheblend", config)
    ctx = SelectionContext(num_tokens=13, num_layers=4, segments=(), candidate_rows=torch.arange(12),
                           candidate_segments=(), ratio=0.25)
    partials = [selector.check_partials(ctx, 0, rank) for rank in ranks]
    assert partials[0].shape == ((2, 12) if metric == "kv" else (12,))  # one tensor: one reduction
    summed = partials[0] + partials[1]
    torch.testing.assert_close(deviation_from_sums(summed, metric), kv_deviation(kv, metric), rtol=1e-5, atol=0)
    both = selector.select_at_check(ctx, 0, kv)
    assert torch.equal(selector.select_at_check(ctx, 0, ranks[0], summed), both)
    assert torch.equal(selector.select_at_check(ctx, 0, ranks[1], summed), both)  # every rank alike
    own = [selector.select_at_check(ctx, 0, rank) for rank in ranks]
    assert not all(torch.equal(rows, both) for rows in own)

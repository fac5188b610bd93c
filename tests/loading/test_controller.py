"""Loading controller: pure math with injected figures (no torch, no clock)."""

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefuse.errors import ConfigError
from cachefuse.loading.controller import (
    RequestShape,
    choose_ratio,
    decide,
    load_time,
    match_ratio,
    preload_depth,
    recompute_time,
    selected_rows,
    tier_bytes,
)
from cachefuse.loading.figures import (
    FIGURE_STALE_S,
    BandwidthMeter,
    ComputeFigures,
    EmaEstimator,
    TierFigures,
    fit_compute_figures,
    fit_prefill,
)
from cachefuse.loading.placement import AccessCounter, placement_moves

MB = 1 << 20
FIG = ComputeFigures(fixed_s=2e-4, per_row_s=2e-6, per_row_key_s=1e-9,
                     prefill_fixed_s=5e-3, prefill_per_token_s=7e-5, prefill_per_token2_s=1e-9)
SHAPE = RequestShape(num_tokens=4000, num_layers=32, num_full_layers=1, num_candidates=3000,
                     num_forced=100, bytes_to_load=512 * MB)
MEMORY = TierFigures("memory", 20e9)
DISK = TierFigures("disk", 2e9)
SLOW_DISK = TierFigures("slow_disk", 0.4e9)


def _decide(shape=SHAPE, tiers=(MEMORY,), **kw):
    args = dict(r_min=0.15, r_max=1.0, ratio_mode="controller", fixed_ratio=0.15, force_fuse=False)
    return decide(shape, FIG, list(tiers), **{**args, **kw})


def test_match_ratio_solves_recompute_equals_load():
    load_s = load_time(SHAPE, [DISK])
    r = match_ratio(SHAPE, FIG, load_s)
    assert 0.0 < r < 1.0
    one_row = (SHAPE.num_layers - SHAPE.num_full_layers) * (FIG.per_row_s + FIG.per_row_key_s * SHAPE.num_tokens)
    # recompute_time rounds rows up: equal to load within one row at every selective layer
    assert 0.0 <= recompute_time(SHAPE, FIG, r) - load_s <= one_row + 1e-12


def test_match_ratio_clamps():
    assert match_ratio(SHAPE, FIG, load_time(SHAPE, [MEMORY])) == 0.0  # full layers alone outlast the load
    tape = [TierFigures("tape", 1e6)]
    assert match_ratio(SHAPE, FIG, load_time(SHAPE, tape)) == 1.0
    no_candidates = RequestShape(100, 4, 1, 0, 10, 10 * MB)
    assert match_ratio(no_candidates, FIG, load_time(no_candidates, tape)) == 1.0


def test_choose_ratio_floor_raise_and_cap():
    r, why = choose_ratio(SHAPE, FIG, load_time(SHAPE, [MEMORY]), 0.15, 1.0)
    assert r == 0.15 and why.startswith("r_min: loading is faster than recomputing r_min")
    disk_s = load_time(SHAPE, [DISK])
    r, why = choose_ratio(SHAPE, FIG, disk_s, 0.15, 1.0)
    assert r == pytest.approx(match_ratio(SHAPE, FIG, disk_s)) and r > 0.15
    assert why.startswith("load-bound: r raised to hide loading")
    r, why = choose_ratio(SHAPE, FIG, disk_s, 0.15, 0.2)
    assert r == 0.2 and why.startswith("capped at r_max")


def test_plain_vllm_is_priced_past_its_own_prefix_cache():
    """vLLM computes only the tokens past its prefix-cache hit, while the blend pass computes every row: a
    request whose first 3,500 of 4,000 tokens vLLM holds runs plain (no-go), priced as 500 new tokens over
    4,000 keys. Negative control: the same request without the hit fuses (priced as a whole prompt, it had
    fused with the hit too, at ~3x vLLM's time)."""
    assert FIG.prefill_time(4000, 3500) == pytest.approx(
        FIG.prefill_fixed_s + FIG.prefill_per_token_s * 500 + FIG.prefill_per_token2_s * (4000**2 - 3500**2))
    assert FIG.prefill_time(4000, 0) == FIG.prefill_time(4000) and FIG.prefill_time(100, 500) == FIG.prefill_fixed_s
    whole = _decide()
    cached = _decide(shape=replace(SHAPE, num_prefix_cached=3500))
    assert whole.fuse and whole.verdict == "go"
    assert not cached.fuse and cached.verdict == "no_go" and "prefix cache holds 3500 of 4000" in cached.reason
    assert cached.est_fused_s == whole.est_fused_s and cached.est_prefill_s < whole.est_fused_s / 2


def test_throttled_tier_raises_r_unthrottled_keeps_r_min():
    fast = TierFigures("disk", 10e9)
    throttled = TierFigures("disk", 2e9)  # 5x slower
    assert _decide(tiers=[fast]).ratio == 0.15
    raised = _decide(tiers=[throttled])
    assert raised.ratio > 0.15 and "load-bound" in raised.reason
    assert raised.est_recompute_s == pytest.approx(raised.est_load_s, rel=0.01)  # loading hidden


def test_go_when_fused_beats_prefill():
    d = _decide(tiers=[MEMORY])
    assert d.fuse and d.reason.startswith("go: ") and d.tier == "memory" and d.verdict == "go"
    assert d.est_fused_s == max(d.est_load_s, d.est_recompute_s) < d.est_prefill_s


def test_no_go_slow_tier_and_force_fuse():
    d = _decide(tiers=[TierFigures("disk", 0.05e9)])
    assert not d.fuse and d.reason.startswith("no-go: ") and "slow tier disk" in d.reason and d.verdict == "no_go"
    assert d.est_fused_s >= d.est_prefill_s
    forced = _decide(tiers=[TierFigures("disk", 0.05e9)], force_fuse=True)
    assert forced.fuse and forced.reason.startswith("force_fuse: ") and forced.verdict == "force_fuse"


def test_no_go_tiny_prompt():
    tiny = RequestShape(num_tokens=8, num_layers=32, num_full_layers=1, num_candidates=4, num_forced=4,
                        bytes_to_load=64 * 1024)
    d = _decide(shape=tiny)
    assert not d.fuse and "recompute-bound" in d.reason  # per-layer fixed costs beat a tiny prefill


def test_fixed_mode_uses_fixed_ratio_and_validates():
    d = _decide(tiers=[DISK], ratio_mode="fixed", fixed_ratio=0.5)
    assert d.ratio == 0.5 and d.reason.endswith("fixed ratio 0.500")
    with pytest.raises(ConfigError, match="ratio_mode"):
        _decide(ratio_mode="auto")
    with pytest.raises(ConfigError, match="r_min"):
        _decide(r_min=0.5, r_max=0.2)


# --------------------------------------------------------------------------- each chunk at its own tier


def disk_matching(ratio: float) -> TierFigures:
    """A disk tier at which loading SHAPE takes as long as recomputing it at `ratio` (r_match = ratio)."""
    return TierFigures("disk", SHAPE.bytes_to_load / recompute_time(SHAPE, FIG, ratio))


def on(**bytes_by_tier: int) -> RequestShape:
    return replace(SHAPE, bytes_by_tier=bytes_by_tier)


ALL = SHAPE.bytes_to_load


def test_chunks_on_a_slow_disk_are_priced_at_the_disk_not_at_the_fastest_tier():
    """memory + a slow disk: pricing every byte at the fastest tier (the rule before per-chunk tiers)
    says r = 0.15 and go; the chunks are on the disk, which alone gives r = 0.38."""
    tiers = [MEMORY, disk_matching(0.38)]
    fastest = _decide(on(memory=ALL), tiers)
    assert fastest.fuse and fastest.ratio == 0.15 and fastest.tier == "memory"
    actual = _decide(on(disk=ALL), tiers)
    disk_alone = _decide(SHAPE, [disk_matching(0.38)])
    assert actual.ratio == pytest.approx(0.38, abs=1e-9) and actual.ratio == disk_alone.ratio
    assert actual.tier == "disk" and "load-bound" in actual.reason and "load disk " in actual.reason
    assert actual.est_load_s == disk_alone.est_load_s > 5 * fastest.est_load_s
    assert actual.est_load_by_tier_s == {"disk": actual.est_load_s}
    # A slower disk: loading cannot be hidden below vLLM's own prefill; the fastest tier would say go.
    slower = [MEMORY, disk_matching(0.7)]
    assert _decide(on(memory=ALL), slower).fuse
    no_go = _decide(on(disk=ALL), slower)
    assert not no_go.fuse and "slow tier disk" in no_go.reason


def test_a_request_split_over_tiers_adds_their_load_times():
    tiers = [MEMORY, disk_matching(0.38)]
    split = _decide(on(memory=ALL // 4, disk=ALL - ALL // 4), tiers)
    memory_s, disk_s = (ALL // 4) / MEMORY.bytes_per_s, (ALL - ALL // 4) / tiers[1].bytes_per_s
    assert split.est_load_by_tier_s == pytest.approx({"memory": memory_s, "disk": disk_s})
    assert split.est_load_s == pytest.approx(memory_s + disk_s) and split.tier == "disk"  # the bottleneck
    assert 0.15 < split.ratio < 0.38
    assert split.ratio == pytest.approx(match_ratio(SHAPE, FIG, memory_s + disk_s))


def test_every_chunk_in_memory_decides_as_before():
    """Negative control: with every byte in the fastest tier, per-chunk pricing changes nothing."""
    tiers = [MEMORY, disk_matching(0.38)]
    assert _decide(on(memory=ALL), tiers) == _decide(SHAPE, [MEMORY])
    assert _decide(on(memory=ALL), tiers).ratio == 0.15


def test_unknown_tiers_are_priced_at_the_slowest_measured():
    tiers = [MEMORY, disk_matching(0.38)]
    on_disk = _decide(on(disk=ALL), tiers)
    assert _decide(SHAPE, tiers) == on_disk  # no breakdown: every byte unknown
    assert _decide(on(redis=ALL), tiers) == on_disk  # a tier without a figure
    half = _decide(on(memory=ALL // 2), tiers)  # the other half unknown
    assert half.est_load_by_tier_s == pytest.approx({"memory": (ALL // 2) / MEMORY.bytes_per_s,
                                                     "disk": (ALL - ALL // 2) / tiers[1].bytes_per_s})
    with pytest.raises(ValueError, match="bytes_by_tier"):
        on(memory=ALL, disk=1)
    with pytest.raises(ValueError, match="measured tier"):
        _decide(SHAPE, [])


def test_tier_bytes_takes_the_fastest_measured_tier_known_to_hold_each_chunk():
    chunks = [(100, ("disk",)), (200, ("disk", "memory")), (40, ()), (8, ("redis",)), (1, ("memory",))]
    assert tier_bytes(chunks, [MEMORY, DISK]) == {"disk": 100, "memory": 201}  # 48 bytes unknown
    assert tier_bytes(chunks, [DISK]) == {"disk": 300}


# --------------------------------------------------------------------------- rows as the selector picks them


def test_rows_planned_per_chunk_do_not_follow_the_ratio():
    """cachecraft recomputes ceil(CFO x chunk) per chunk (Selector.estimate_rows), not r x tokens: 950
    rows where 15% of the candidates would be 450, and raising r would hide no loading."""
    cachecraft = replace(SHAPE, num_full_layers=0, num_planned_rows=950, num_ratio_candidates=0)
    by_ratio = replace(SHAPE, num_full_layers=0)
    assert selected_rows(cachecraft, 0.15) == selected_rows(cachecraft, 0.9) == 950
    assert selected_rows(by_ratio, 0.15) == 450
    d = _decide(cachecraft, [disk_matching(0.38)])
    assert d.ratio == 0.15 and "no row depends on r" in d.reason and d.est_rows == 950
    assert d.est_recompute_s == pytest.approx(32 * FIG.layer_time(950 + SHAPE.num_forced, SHAPE.num_tokens))
    assert d.est_recompute_s > _decide(by_ratio, [disk_matching(0.38)], ratio_mode="fixed").est_recompute_s
    every = _decide(replace(cachecraft, num_planned_rows=SHAPE.num_candidates), [MEMORY])
    assert not every.fuse and "every row recomputed (3000 of 3000)" in every.reason
    mixed = replace(SHAPE, num_planned_rows=200, num_ratio_candidates=1000)  # one chunk without a CFO
    assert selected_rows(mixed, 0.15) == 200 + 150


def test_preload_depth_formula():
    assert preload_depth(32, 1.0, 2.0) == math.ceil(31 * 0.5 + 1) == 17
    assert preload_depth(32, 1.0, 10.0) == math.ceil(31 * 0.9 + 1) == 29
    assert preload_depth(5, 1.0, 2.0) == 3  # Cache-Craft Fig. 19
    assert preload_depth(32, 2.0, 1.0) == 1
    assert preload_depth(32, 1.0, 1.0) == 1
    assert preload_depth(1, 1.0, 100.0) == 1
    assert preload_depth(32, 0.0, 1.0) == 32


def test_ema_seed_and_convergence():
    e = EmaEstimator(0.5)
    assert e.value is None and e.count == 0
    assert e.update(10.0) == 10.0
    assert e.update(20.0) == 15.0 and e.count == 2
    seeded = EmaEstimator(0.3, initial=100.0)
    for _ in range(60):
        seeded.update(5.0)
    assert seeded.value == pytest.approx(5.0, rel=1e-6)
    with pytest.raises(ValueError):
        EmaEstimator(0.0)


def test_bandwidth_meter_ignores_tiny_loads_and_converges():
    m = BandwidthMeter(alpha=0.25, min_bytes=MB, probes={"memory": 10e9})
    assert m.bytes_per_s("disk") is None
    assert not m.observe("disk", 4096, 1e-6)  # tiny: would read as 4 GB/s
    assert not m.observe("disk", 8 * MB, 0.0)
    assert m.bytes_per_s("disk") is None
    for _ in range(50):
        assert m.observe("disk", 100 * MB, 100 * MB / 1e9)
    assert m.bytes_per_s("disk") == pytest.approx(1e9, rel=1e-6)
    assert m.bytes_per_s("memory") == 10e9
    figs = {t.name: t for t in m.tier_figures(["memory", "disk", "redis"])}
    assert set(figs) == {"memory", "disk"} and figs["disk"].bytes_per_s == pytest.approx(1e9, rel=1e-6)


def test_a_stale_tier_figure_is_replaced_by_its_next_read_not_averaged():
    """A figure unread for FIGURE_STALE_S (a load-bound no-go kept the tier from being read) takes the next
    read as it is: averaged in at alpha, a one-off slow first read would need ~10 more reads to fade."""
    now = [0.0]
    m = BandwidthMeter(alpha=0.2, min_bytes=MB, clock=lambda: now[0])
    m.observe("disk", 100 * MB, 10.0)  # a hiccup: 10 MB/s, seeding the figure
    now[0] = 1.0
    m.observe("disk", 100 * MB, 0.1)  # fresh: averaged (1 GB/s pulls it up by a fifth)
    assert m.bytes_per_s("disk") == pytest.approx(0.8 * 10 * MB + 0.2 * 1000 * MB)
    now[0] = 1.0 + FIGURE_STALE_S
    m.observe("disk", 100 * MB, 0.1)
    assert m.bytes_per_s("disk") == pytest.approx(1000 * MB)


def test_fit_compute_figures_recovers_coefficients():
    true = ComputeFigures(fixed_s=3e-4, per_row_s=2e-6, per_row_key_s=5e-10)
    samples = [(r, c, true.layer_time(r, c)) for r in (16, 128, 512, 2048) for c in (512, 2048, 8192)]
    fit = fit_compute_figures(samples)
    assert fit.fixed_s == pytest.approx(3e-4, rel=1e-6)
    assert fit.per_row_s == pytest.approx(2e-6, rel=1e-6)
    assert fit.per_row_key_s == pytest.approx(5e-10, rel=1e-6)


def test_fit_compute_figures_non_negative_and_few_samples():
    # a decreasing trend would need a negative slope: clamped to 0
    fit = fit_compute_figures([(10, 100, 5.0), (20, 100, 4.0), (30, 200, 3.0), (40, 300, 2.0)])
    assert min(fit.fixed_s, fit.per_row_s, fit.per_row_key_s) >= 0.0
    base = ComputeFigures(fixed_s=1.0, per_row_s=1.0, per_row_key_s=0.0, prefill_fixed_s=7.0)
    scaled = fit_compute_figures([(9, 50, 20.0)], base=base)  # base predicts 10: scale 2
    assert (scaled.fixed_s, scaled.per_row_s, scaled.per_row_key_s) == pytest.approx((2.0, 2.0, 0.0))
    assert scaled.prefill_fixed_s == 7.0
    only = fit_compute_figures([(100, 10, 1e-3)])
    assert only.per_row_s == pytest.approx(1e-5) and only.fixed_s == 0.0
    assert fit_compute_figures([]) == ComputeFigures()


def test_fit_prefill_recovers_coefficients():
    samples = [(n, FIG.prefill_time(n)) for n in (64, 256, 1024, 4096, 16384)]
    fit = fit_prefill(samples, base=ComputeFigures(fixed_s=1.0))
    assert fit.fixed_s == 1.0
    assert fit.prefill_fixed_s == pytest.approx(FIG.prefill_fixed_s, rel=1e-6)
    assert fit.prefill_per_token_s == pytest.approx(FIG.prefill_per_token_s, rel=1e-6)
    assert fit.prefill_per_token2_s == pytest.approx(FIG.prefill_per_token2_s, rel=1e-6)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_access_counter_decays_on_injected_clock():
    clock = FakeClock()
    c = AccessCounter(half_life_s=10.0, clock=clock)
    c.record("a")
    c.record("a")
    assert c.frequency("a") == 2.0 and c.frequency("b") == 0.0
    clock.now = 10.0
    assert c.frequency("a") == pytest.approx(1.0)
    assert c.record("a") == pytest.approx(2.0)
    clock.now = 30.0
    assert c.frequency("a") == pytest.approx(0.5)
    c.forget("a")
    assert c.frequency("a") == 0.0


def test_placement_moves_promote_and_demote():
    clock = FakeClock()
    c = AccessCounter(half_life_s=60.0, clock=clock)
    for _ in range(5):
        c.record("hot")
    c.record("warm")
    c.record("hot_fastest")
    c.record("hot_fastest")
    c.record("hot_fastest")
    tiers = [DISK, MEMORY, SLOW_DISK]
    where = {"hot": "disk", "warm": "disk", "cold": "disk", "cold_slowest": "slow_disk",
             "hot_fastest": "memory", "elsewhere": "redis"}
    moves = placement_moves(c, where, tiers, hot_threshold=3.0, cold_threshold=0.5)
    assert moves == [("hot", "disk", "memory"), ("cold", "disk", "slow_disk")]
    clock.now = 600.0  # everything cools down
    moves = placement_moves(c, {"hot": "memory"}, tiers, hot_threshold=3.0, cold_threshold=0.5)
    assert moves == [("hot", "memory", "disk")]
    with pytest.raises(ValueError):
        placement_moves(c, where, tiers, hot_threshold=1.0, cold_threshold=1.0)


@settings(max_examples=200, deadline=None)
@given(num_tokens=st.integers(1, 32768), num_layers=st.integers(1, 80), full=st.integers(0, 80),
       cand_frac=st.floats(0.0, 1.0), forced=st.integers(0, 64), num_bytes=st.integers(0, 1 << 34),
       bps=st.floats(1e6, 1e11), r_min=st.floats(0.0, 1.0), width=st.floats(0.0, 1.0),
       force=st.booleans())
def test_decide_properties(num_tokens, num_layers, full, cand_frac, forced, num_bytes, bps, r_min, width,
                           force):
    r_max = min(1.0, r_min + width)
    shape = RequestShape(num_tokens, num_layers, min(full, num_layers), int(cand_frac * num_tokens),
                         forced, num_bytes)
    d = decide(shape, FIG, [TierFigures("t", bps), MEMORY], r_min=r_min, r_max=r_max,
               ratio_mode="controller", fixed_ratio=0.15, force_fuse=force)
    assert r_min <= d.ratio <= r_max
    assert d.est_fused_s >= d.est_recompute_s and d.est_fused_s >= d.est_load_s
    assert 1 <= d.preload_depth <= num_layers
    every_row = shape.num_candidates > 0 and selected_rows(shape, d.ratio) >= shape.num_candidates
    assert d.fuse == (force or (d.est_fused_s < 0.9 * d.est_prefill_s and not every_row))


def test_pipeline_depth_sizes_the_buffer_for_heavy_full_layers():
    from cachefuse.loading.controller import pipeline_depth, pipeline_finish

    # CacheBlend-like: two heavy full layers, ten light ones; loading about as slow as the average layer.
    compute = [0.122, 0.041] + [0.027] * 10
    load = sum(compute) / len(compute)
    assert preload_depth(12, sum(compute) / 12, load) == 1  # Eq. 16 on averages: depth 1
    depth = pipeline_depth(compute, load)
    assert depth > 1
    assert pipeline_finish(compute, load, depth) < pipeline_finish(compute, load, 1)
    assert pipeline_finish(compute, load, depth) <= 1.02 * pipeline_finish(compute, load, 12)
    assert pipeline_depth([0.01] * 8, 0.001) == 1  # loading far faster: one layer ahead suffices


def test_every_row_recomputed_is_a_no_go():
    shape = RequestShape(num_tokens=1000, num_layers=8, num_full_layers=2, num_candidates=900, num_forced=100,
                         bytes_to_load=10**9)
    figures = ComputeFigures(per_row_s=1e-6, prefill_per_token_s=1e-3)
    slow = TierFigures("disk", 1e6)  # loading takes 1000 s: r climbs to r_max
    d = decide(shape, figures, [slow], r_min=0.15, r_max=1.0, ratio_mode="controller", fixed_ratio=0.15,
               force_fuse=False)
    assert d.ratio == 1.0 and not d.fuse and "every row recomputed" in d.reason


@pytest.mark.parametrize(("num_layers", "t_compute", "t_load", "expected"), [
    (32, 3.0, 16.0, 27),  # Llama-7B, NVMe (CacheBlend §5): ceil(31 * 13/16 + 1) = ceil(26.19)
    (80, 7.0, 4.0, 1),  # Llama-70B: loading keeps up
    (3, 1.0, 2.0, 2),  # exactly 2.0, no rounding up to 3
    (8, 0.0, 1.0, 8),  # free compute: load everything ahead
    (8, 1.0, 1.0, 1),
    (1, 0.0, 5.0, 1),
    (4, 0.0, 0.0, 1),
])
def test_preload_depth_cases(num_layers, t_compute, t_load, expected):
    assert preload_depth(num_layers, t_compute, t_load) == expected


def test_preload_depth_bounds():
    for num_layers in (1, 2, 7, 32):
        depths = [preload_depth(num_layers, t_compute, 1.0) for t_compute in (0.0, 0.1, 0.5, 0.9, 1.5)]
        assert all(1 <= d <= num_layers for d in depths)
        assert depths == sorted(depths, reverse=True)  # faster compute never needs fewer layers ahead
    with pytest.raises(ValueError):
        preload_depth(0, 1.0, 2.0)
    with pytest.raises(ValueError):
        preload_depth(4, -1.0, 2.0)


def test_a_question_probe_is_priced_and_its_load_is_not_hidden():
    """A query-aware selector probes the question before the pass, over entries it loads whole first:
    the estimate adds the probe's layers and the load (no overlap); r stays r_min and depth 0. The same
    shape without a probe (the control) overlaps the load and prices no probe."""
    probe_shape = replace(SHAPE, num_full_layers=0, num_probe_layers=20)
    plain_shape = replace(probe_shape, num_probe_layers=0)
    for tiers in ([MEMORY], [DISK]):
        probed, plain = _decide(probe_shape, tiers), _decide(plain_shape, tiers)
        probe_s = 20 * FIG.layer_time(SHAPE.num_forced, SHAPE.num_tokens)
        assert probed.est_probe_s == pytest.approx(probe_s) and plain.est_probe_s == 0.0
        assert probed.ratio == 0.15 and probed.preload_depth == 0
        assert probed.est_recompute_s == pytest.approx(recompute_time(probe_shape, FIG, 0.15) + probe_s)
        assert probed.est_fused_s == pytest.approx(probed.est_load_s + probed.est_recompute_s)
        assert plain.est_fused_s == max(plain.est_load_s, plain.est_recompute_s) < probed.est_fused_s
    assert _decide(plain_shape, [DISK]).ratio > 0.15  # the control raises r to hide the disk load
    assert "probe" in _decide(probe_shape, [DISK]).reason

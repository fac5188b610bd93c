"""The loading controller from figures measured on real blend passes: a tier throttled by a test
double (5x slower, on an injectable clock: no test waits) makes the controller raise r; the
unthrottled tier keeps r at r_min. And the recorder's rules for compute samples: the first pass is
warm-up (not sampled), and a pass after FIGURE_STALE_S without one replaces the samples."""

from types import SimpleNamespace

import pytest

from cachefuse.loading.controller import RequestShape, decide
from cachefuse.loading.figures import FIGURE_STALE_S, ComputeFigures, FigureRecorder
from tests.helpers.fusion import make_case, make_engine, precompute_case
from tests.helpers.throttled import FakeClock


class SlowTier:
    """A store whose reads advance the engine's clock by bytes / bytes_per_s (a tier of that speed)."""

    def __init__(self, inner, clock: FakeClock, bytes_per_s: float, name: str) -> None:
        self.inner, self.clock, self.bytes_per_s, self.name = inner, clock, bytes_per_s, name

    def get(self, key):
        entry = self.inner.get(key)
        if entry is not None:
            self.clock.sleep(entry.nbytes / self.bytes_per_s)
        return entry

    def __getattr__(self, name):
        return getattr(self.inner, name)


def measured_decision(tiny_model_dir, bytes_per_s: float):
    from cachefuse.adapters.hf import HFAdapter

    adapter = HFAdapter.from_pretrained(str(tiny_model_dir("llama")))
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size)
    precompute_case(engine, case, with_hole=False)
    clock = FakeClock()
    engine.store = SlowTier(engine.store, clock, bytes_per_s, "tier")
    engine.clock = clock
    recorder = FigureRecorder(min_load_bytes=0)  # (the first pass's compute is not sampled; its load is)
    _, stats = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=0.15, save_holes=False)
    recorder.observe_blend(stats, len(case.token_ids))
    (tier,) = recorder.bandwidth.tier_figures(["tier"])
    assert abs(tier.bytes_per_s - bytes_per_s) / bytes_per_s < 1e-6  # measured, through the engine's clock
    loaded = sum(e - s for s, e in case.chunks)
    shape = RequestShape(num_tokens=len(case.token_ids), num_layers=adapter.shape.num_layers, num_full_layers=2,
                         num_candidates=loaded - len(case.system), num_forced=len(case.token_ids) - loaded,
                         bytes_to_load=stats.bytes_loaded)
    # Compute figures: 100 us per row per layer (r_min: ~23 ms, r=1: ~35 ms); vLLM's own prefill 94 ms.
    compute = ComputeFigures(per_row_s=1e-4, prefill_per_token_s=1e-3)
    decision = decide(shape, compute, [tier], r_min=0.15, r_max=1.0, ratio_mode="controller", fixed_ratio=0.15,
                      force_fuse=False)
    return decision, stats.bytes_loaded


def test_throttled_tier_raises_r_and_fast_tier_keeps_r_min(tiny_model_dir):
    fast, num_bytes = measured_decision(tiny_model_dir, bytes_per_s=1e9)
    slow, _ = measured_decision(tiny_model_dir, bytes_per_s=num_bytes / 0.030)  # loading 30 ms: ~170x slower
    assert fast.fuse and fast.ratio == 0.15 and "r_min" in fast.reason
    assert slow.fuse and slow.ratio > 0.15 and "load-bound" in slow.reason
    assert slow.est_load_s > 5 * fast.est_load_s


def pass_stats(seconds_per_row: float, rows=(100, 100, 20, 1)) -> SimpleNamespace:
    """A blend pass's figures as FusionStats carries them: 1 MiB read from memory, per-layer rows and times."""
    return SimpleNamespace(load_seconds_by_tier={"memory": 1e-3}, load_bytes_by_tier={"memory": 1 << 20},
                           layer_rows=list(rows), layer_seconds=[seconds_per_row * r for r in rows])


def test_the_first_blend_is_warm_up_its_compute_unsampled_its_load_measured():
    """A process's first pass pays one-time costs (on a GPU, kernels compiled in it): fitted, it priced every
    later blend 100x too slow here, and the controller would turn requests down on that. Negative control:
    with no warm-up pass, the first pass's compute is sampled."""
    recorder = FigureRecorder(clock=lambda: 0.0)
    recorder.observe_blend(pass_stats(1e-2), num_tokens=100)  # cold: 100x the steady per-row time
    assert len(recorder.blend_samples) == 0 and recorder.bandwidth.bytes_per_s("memory") == (1 << 20) / 1e-3
    recorder.observe_blend(pass_stats(1e-4), num_tokens=100)
    assert recorder.compute_figures().layer_time(100, 100) == pytest.approx(1e-2)  # 100 rows at 100 us
    unwarmed = FigureRecorder(warmup_blends=0, clock=lambda: 0.0)
    unwarmed.observe_blend(pass_stats(1e-2), num_tokens=100)
    unwarmed.observe_blend(pass_stats(1e-4), num_tokens=100)
    assert unwarmed.compute_figures().layer_time(100, 100) > 0.4  # the cold pass weighs in


def test_a_blend_after_a_long_gap_replaces_the_compute_samples():
    """No blend for FIGURE_STALE_S (the scheduler turned every request down on these figures): the pass it
    fuses to re-measure replaces them, rather than being averaged with the samples it is to correct.
    Negative control: a pass within the window is averaged in."""
    now = [0.0]
    recorder = FigureRecorder(warmup_blends=0, clock=lambda: now[0])
    recorder.observe_blend(pass_stats(1e-2), num_tokens=100)  # a busy machine: blends measured slow
    now[0] = FIGURE_STALE_S - 1
    recorder.observe_blend(pass_stats(1e-4), num_tokens=100)
    assert len(recorder.blend_samples) == 8 and recorder.compute_figures().layer_time(100, 100) > 0.4
    now[0] = 2 * FIGURE_STALE_S
    recorder.observe_blend(pass_stats(1e-4), num_tokens=100)
    assert len(recorder.blend_samples) == 4
    assert recorder.compute_figures().layer_time(100, 100) == pytest.approx(1e-2)

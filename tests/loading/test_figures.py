"""The loading controller from figures measured on real blend passes: a tier throttled by a test
double (5x slower, on an injectable clock: no test waits) makes the controller raise r; the
unthrottled tier keeps r at r_min."""

from cachefuse.loading.controller import RequestShape, decide
from cachefuse.loading.figures import ComputeFigures, FigureRecorder
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
    recorder = FigureRecorder(min_load_bytes=0)
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

"""The loading controller in a real engine started with the default config (the controller is the
default `ratio_mode`): the worker's measured figures reach the scheduler, and the scheduler's decision
(ratio, go/no-go) shapes the request, with injected figures so the outcome does not depend on this
machine's speed. Negative control: the same engine switched to `ratio_mode: fixed` fuses what the
default runs plain."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.vllm_engines import (
    first_logprobs,
    generate,
    precompute,
    scheduler_connector,
    start_engine,
    stop_engine,
    worker_side,
)


@pytest.fixture(scope="module")
def family():
    return "llama"


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    llm = start_engine(tiny_model_dir("llama"), tmp_path_factory.mktemp("controller-store"))  # the defaults
    config = scheduler_connector(llm)._scheduler.config
    assert (config.ratio_mode, config.recompute_ratio) == ("controller", 0.15)
    worker_side().figures.bandwidth.min_bytes = 0  # tiny test entries still count as loads
    g = torch.Generator().manual_seed(5)
    system, a, c, question = (torch.randint(3, 1000, (n,), generator=g).tolist() for n in (10, 60, 50, 9))
    precompute(llm, system, [a, c])
    ids = system + a + c + question
    params = {"cachefuse": {"chunks": [[0, 10], [10, 70], [70, 120]]}}
    yield llm, ids, params
    stop_engine(llm)


def test_measured_figures_reach_the_scheduler(setup):
    llm, ids, params = setup
    generate(llm, [ids], [None])  # a step of plain prefill only: vLLM's own speed
    for _ in range(2):  # blends: load bandwidth and per-layer compute (a process's first blend is warm-up)
        generate(llm, [ids], [params])
    figures = scheduler_connector(llm)._scheduler.figures
    assert figures["samples"]["prefill_steps"] >= 1 and figures["samples"]["blend_layers"] >= 4, figures
    assert figures["tiers"]["memory"] > 0
    assert figures["compute"]["prefill_per_token_s"] + figures["compute"]["prefill_fixed_s"] > 0


# Loading 246 KB at this rate (33 ms) takes longer than the pass at r_min and less than recomputing every
# candidate row (38 ms; chunk a's 50 rows only: c, after the system prompt it was stored after, is exact)
LOAD_BETWEEN_BYTES_PER_S = 7.5e6


def inject(llm, *, bytes_per_s: float, prefill_per_token_s: float, per_row_s: float = 1e-6) -> None:
    scheduler_connector(llm)._scheduler.figures = {
        "tiers": {"memory": bytes_per_s},
        "compute": {"fixed_s": 0.0, "per_row_s": per_row_s, "per_row_key_s": 0.0, "prefill_fixed_s": 0.0,
                    "prefill_per_token_s": prefill_per_token_s, "prefill_per_token2_s": 0.0},
        "samples": {"blend_layers": 100, "prefill_steps": 10}}


def test_slow_tier_is_a_no_go_and_runs_plain(setup):
    llm, ids, params = setup
    (plain,) = generate(llm, [ids], [None])
    inject(llm, bytes_per_s=1e3, prefill_per_token_s=1e-5)  # loading would take minutes
    (out,) = generate(llm, [ids], [params])
    stats = out.kv_transfer_params["cachefuse"]
    assert stats["status"] == "fallback" and stats["fallback_reason"] == "no_go", stats
    assert stats["detail"].startswith("no-go:") and "slow tier memory" in stats["detail"]
    assert first_logprobs(out) == first_logprobs(plain)
    assert scheduler_connector(llm).counters["fallback:no_go"] >= 1


def test_a_fixed_ratio_engine_fuses_what_the_default_runs_plain(setup):
    """Negative control of the no-go above: the same figures under `ratio_mode: fixed` (the old default)
    fuse at the fixed ratio, with no controller decision."""
    llm, ids, params = setup
    side = scheduler_connector(llm)._scheduler
    inject(llm, bytes_per_s=1e3, prefill_per_token_s=1e-5)
    config = side.config
    side.config = config.replace(ratio_mode="fixed")
    try:
        (out,) = generate(llm, [ids], [params])
    finally:
        side.config = config
    stats = out.kv_transfer_params["cachefuse"]
    assert stats["status"] == "fused" and stats["recompute_ratio"] == 0.15 and "controller" not in stats, stats


def test_force_fuse_overrides_the_no_go(setup):
    llm, ids, params = setup
    side = scheduler_connector(llm)._scheduler
    inject(llm, bytes_per_s=1e3, prefill_per_token_s=1e-5)
    config = side.config
    side.config = config.replace(force_fuse=True)
    try:
        (out,) = generate(llm, [ids], [params])
    finally:
        side.config = config
    stats = out.kv_transfer_params["cachefuse"]
    assert stats["status"] == "fused" and stats["controller"]["reason"].startswith("force_fuse:"), stats


def test_fast_tier_fuses_at_r_min_and_slow_loading_raises_r(setup):
    llm, ids, params = setup
    inject(llm, bytes_per_s=1e12, prefill_per_token_s=1.0)  # loading free, vLLM's prefill slow
    (out,) = generate(llm, [ids], [params])
    stats = out.kv_transfer_params["cachefuse"]
    assert stats["status"] == "fused" and stats["recompute_ratio"] == 0.15, stats
    assert stats["controller"]["reason"].startswith("go:") and "r_min" in stats["controller"]["reason"]
    inject(llm, bytes_per_s=LOAD_BETWEEN_BYTES_PER_S, prefill_per_token_s=1.0, per_row_s=1e-4)  # loading between r_min and r=1 compute
    (out,) = generate(llm, [ids], [params])
    stats = out.kv_transfer_params["cachefuse"]
    assert stats["status"] == "fused" and stats["recompute_ratio"] > 0.15, stats
    assert "load-bound" in stats["controller"]["reason"]


def test_derived_preload_depth_pipelines_with_the_same_output(setup, monkeypatch):
    llm, ids, params = setup
    side = scheduler_connector(llm)._scheduler
    depths = []
    original = worker_side().engine.fuse_steps

    def spy(plan):
        depths.append(plan.preload_depth)
        return original(plan)

    monkeypatch.setattr(worker_side().engine, "fuse_steps", spy)
    inject(llm, bytes_per_s=LOAD_BETWEEN_BYTES_PER_S, prefill_per_token_s=1.0, per_row_s=1e-4)
    (serial,) = generate(llm, [ids], [params])  # config preload_depth 0: serial
    config = side.config
    side.config = config.replace(preload_depth=None)  # derived from the controller's decision
    try:
        inject(llm, bytes_per_s=LOAD_BETWEEN_BYTES_PER_S, prefill_per_token_s=1.0, per_row_s=1e-4)
        (pipelined,) = generate(llm, [ids], [params])
    finally:
        side.config = config
    decided = pipelined.kv_transfer_params["cachefuse"]["controller"]["preload_depth"]
    assert depths == [None, decided] and decided >= 1
    assert first_logprobs(pipelined) == first_logprobs(serial)

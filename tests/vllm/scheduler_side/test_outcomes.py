"""RequestOutcome and Outcomes on their own: the response's keys, figures arriving after request_finished, and
what a finished request adds to the Prometheus stats."""

from __future__ import annotations

import pickle

from cachefuse.chunks import PARAMS_KEY
from cachefuse.vllm.metrics import CacheFuseConnectorStats
from cachefuse.vllm.scheduler_side.outcomes import Outcomes, RequestOutcome


def planned() -> RequestOutcome:
    return RequestOutcome(status="planned", selector="cacheblend", recompute_ratio=0.15, chunks=3, chunks_indexed=2)


def test_to_response_says_only_what_is_set_under_the_params_key():
    assert planned().to_response() == {PARAMS_KEY: {"status": "planned", "selector": "cacheblend",
                                                     "recompute_ratio": 0.15, "chunks": 3, "chunks_indexed": 2}}
    fallback = RequestOutcome(status="fallback", fallback_reason="malformed_request", detail="bad", field="x")
    assert fallback.to_response()[PARAMS_KEY] == {"status": "fallback", "fallback_reason": "malformed_request",
                                                  "detail": "bad", "field": "x"}


def test_the_later_write_of_a_key_wins_and_a_figure_sent_as_none_is_kept():
    outcome = planned()
    outcome.add_figures({"status": "fused", "fallback_reason": None, "recompute_ratio": 0.2, "chunks_hit": 2})
    assert outcome.to_dict() == {"status": "fused", "fallback_reason": None, "selector": "cacheblend",
                                 "recompute_ratio": 0.2, "chunks": 3, "chunks_indexed": 2, "chunks_hit": 2}
    outcome.update(status="fallback", fallback_reason="replay_prompt_changed", fused_before_preemption=True)
    said = outcome.to_dict()
    assert said["status"] == "fallback" and said["fallback_reason"] == "replay_prompt_changed"
    assert said["fused_before_preemption"] is True and said["chunks_hit"] == 2


def test_figures_arriving_after_request_finished_fill_the_returned_dict():
    outcomes = Outcomes(CacheFuseConnectorStats())
    outcome = planned()
    params = outcomes.request_finished("r1", outcome, figures_due=True)
    assert params[PARAMS_KEY]["status"] == "planned" and not outcomes.counters["requests_fused"]
    outcomes.record_blend("r1", {"status": "fused", "fallback_reason": None, "chunks_hit": 2}, None)
    assert params[PARAMS_KEY]["status"] == "fused" and params[PARAMS_KEY]["chunks_hit"] == 2  # the same dict
    assert outcomes.counters["requests_fused"] == 1 and not outcomes.awaiting


def test_a_returned_outcome_with_no_figures_by_the_end_of_the_step_did_not_run():
    outcomes = Outcomes(CacheFuseConnectorStats())
    params = outcomes.request_finished("r1", planned(), figures_due=True)
    outcomes.end_step()
    assert params[PARAMS_KEY]["status"] == "not_run" and "no figures" in params[PARAMS_KEY]["detail"]
    assert not outcomes.awaiting and not outcomes.counters["requests_fused"]


def test_an_outcome_pickles_and_compares_without_its_response():
    outcome = planned()
    handed_out = outcome.to_response()
    assert pickle.loads(pickle.dumps(outcome)) == outcome == planned()
    assert handed_out[PARAMS_KEY] is outcome.to_response()[PARAMS_KEY]


def test_a_finished_request_counts_its_controller_verdict_and_its_ratio_once():
    """The controller's verdict of each finished request (a no-go is only a fallback reason by then) and the
    ratio of each fused one; a request the controller never saw (fixed ratio, other fallbacks) has no verdict."""
    stats = CacheFuseConnectorStats()
    outcomes = Outcomes(stats)
    decided = planned()
    decided.update(controller={"fuse": True, "verdict": "go", "ratio": 0.3}, recompute_ratio=0.3)
    outcomes.request_finished("go", decided, figures_due=True)
    outcomes.record_blend("go", {"status": "fused"}, None)
    outcomes.fall_back("slow", "no_go", detail="no-go: ...")
    outcomes.request_finished("slow", None, figures_due=False)
    outcomes.fall_back("bad", "malformed_request", detail="bad chunks")
    outcomes.request_finished("bad", None, figures_due=False)
    fixed = planned()
    outcomes.request_finished("fixed", fixed, figures_due=True)
    outcomes.record_blend("fixed", {"status": "fused"}, None)
    assert {k: v for k, v in stats.data.items() if k.startswith("controller_")} == {
        "controller_go": 1, "controller_no_go": 1}
    assert stats.data["samples_recompute_ratio"] == [0.3, 0.15]  # fused requests only, each once

"""The scheduler half on its own: idempotent plans, allocation failing after the hook, the per-step
blend budget, outcomes filled in place, and no state left behind (leak check)."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from transformers import AutoConfig

from cachefuse.chunks import chunk_key
from cachefuse.config import CacheFuseConfig
from cachefuse.metadata.base import VariantRecord, record_to_dict
from cachefuse.vllm.messages import CacheFuseWorkerMeta
from cachefuse.vllm.scheduler_side import planning as planning_module
from cachefuse.vllm.scheduler_side.hooks import SchedulerSide
from tests.helpers.hostile import kv_transfer_params


@pytest.fixture
def make_side(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    hf_config = AutoConfig.from_pretrained(path)  # vLLM's model_config.hf_text_config: the KV geometry

    def make(**config) -> SchedulerSide:
        """Synchronous loads unless `blend_step_tokens` is given: these tests drive the hooks as vLLM does
        for them (plans go out when the request's prompt is scheduled); test_async_* drive the other path."""
        config = {"blend_step_tokens": 0, **config}
        vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(model=str(path), dtype=torch.float32, tokenizer=str(path), revision=None,
                                         hf_text_config=hf_config),
            cache_config=SimpleNamespace(block_size=16, enable_prefix_caching=False, prefix_caching_hash_algo="sha256",
                                         cache_dtype="auto"),
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=2048, async_scheduling=False))
        return SchedulerSide(vllm_config, CacheFuseConfig(store_dir=str(tmp_path / "store"), **config))

    return make


def request(req_id: str, num_tokens: int = 100, params: dict | None = None):
    params = {"cachefuse": {"chunks": [[0, 10], [10, 60]]}} if params is None else params
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(range(3, 3 + num_tokens)),
                           kv_transfer_params=params)


def blocks(num_tokens: int, block_size: int = 16, first: int = 7):
    ids = list(range(first, first + -(-num_tokens // block_size)))
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def step_output(*reqs, resumed=(), resumed_first_block: int = 40, first_tokens=()):
    """A SchedulerOutput: `reqs` scheduled as new, `resumed` as preempted requests resumed this step (vLLM
    lists those among the cached requests, with a whole new block table), `first_tokens` the request ids
    of asynchronous loads whose last prompt token it computes (their blends ended)."""
    new = [SimpleNamespace(req_id=r.request_id, block_ids=(blocks(len(r.prompt_token_ids)).get_block_ids()[0],))
           for r in reqs]
    cached = SimpleNamespace(
        req_ids=[r.request_id for r in resumed], resumed_req_ids={r.request_id for r in resumed},
        new_block_ids=[(blocks(len(r.prompt_token_ids), first=resumed_first_block).get_block_ids()[0],)
                       for r in resumed])
    return SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                           num_scheduled_tokens={**{r.request_id: len(r.prompt_token_ids) for r in reqs},
                                                 **dict.fromkeys(first_tokens, 1)})


def schedule(side: SchedulerSide, req, **resumed) -> list:
    """What vLLM does to schedule `req` in one step (hook, allocation, metadata): the plans sent. With
    `resumed_first_block`, the request is a preempted one resumed into new blocks from there."""
    matched, _ = side.get_num_new_matched_tokens(req, 0)
    first = resumed.get("resumed_first_block", 7)
    side.update_state_after_alloc(req, blocks(len(req.prompt_token_ids), first=first), matched)
    output = step_output(resumed=[req], **resumed) if resumed else step_output(req)
    return side.build_connector_meta(output).plans


def worker_reports(side: SchedulerSide, req_id: str | None, **figures) -> None:
    """The step's worker metadata: the request's blend figures (None: nothing to report)."""
    stats = {} if req_id is None else {req_id: {"status": "fused", "fallback_reason": None, **figures}}
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=CacheFuseWorkerMeta(request_stats=stats)))


def assert_no_state(side: SchedulerSide) -> None:
    assert not side.planner.pending and not side.outcomes.fallbacks and not side.outcomes.awaiting and not side.outcomes.resumed_plain
    assert not side.gate.remeasuring


def test_hook_is_idempotent_and_plans_once(make_side):
    side = make_side()
    req = request("r1")
    assert side.get_num_new_matched_tokens(req, 0) == (99, False)
    assert side.get_num_new_matched_tokens(req, 0) == (99, False)  # vLLM may call it again
    side.update_state_after_alloc(req, blocks(100), 99)
    meta = side.build_connector_meta(step_output(req))
    assert [p.req_id for p in meta.plans] == ["r1"]
    plan = meta.plans[0]
    assert plan.slot_mapping[:3] == [7 * 16, 7 * 16 + 1, 7 * 16 + 2] and len(plan.slot_mapping) == 100
    assert plan.slot_mapping[16] == 8 * 16 and plan.block_ids == [7, 8, 9, 10, 11, 12, 13]
    assert plan.error_block_ids == [7, 8, 9, 10, 11, 12, 13]  # the blocks of positions 0..98
    assert side.build_connector_meta(step_output(req)).plans == []  # sent once
    done, params = side.request_finished(req, [])
    assert done is False and params["cachefuse"]["status"] == "planned"
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=CacheFuseWorkerMeta(
        request_stats={"r1": {"status": "fused", "fallback_reason": None, "chunks_hit": 2}}, saved_keys=["k1"])))
    assert params["cachefuse"]["status"] == "fused" and params["cachefuse"]["chunks_hit"] == 2  # in place
    assert "k1" in side.index and side.counters["requests_fused"] == 1
    assert_no_state(side)


def test_allocation_failing_after_the_hook_leaves_the_plan_unsent(make_side):
    side = make_side()
    req = request("r1")
    side.get_num_new_matched_tokens(req, 0)
    assert side.build_connector_meta(step_output()).plans == []  # not scheduled
    side.get_num_new_matched_tokens(req, 0)  # retried in a later step
    side.update_state_after_alloc(req, blocks(100), 99)
    assert len(side.build_connector_meta(step_output(req)).plans) == 1
    side.request_finished(req, [])
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None))
    assert_no_state(side)


def test_aborted_before_scheduling_leaves_nothing_and_says_it_never_ran(make_side):
    side = make_side()
    req = request("r1")
    side.get_num_new_matched_tokens(req, 0)
    _, params = side.request_finished(req, [])
    assert params["cachefuse"]["status"] == "not_run"  # never the internal "planned"
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None))
    assert_no_state(side)


def test_a_preempted_request_is_planned_again_with_its_new_blocks_when_resumed(make_side):
    side = make_side()
    req = request("r1")
    (first,) = schedule(side, req)
    worker_reports(side, "r1")
    # vLLM preempts r1 (its blocks are freed), later resumes it and asks the connector again.
    (again,) = schedule(side, req, resumed_first_block=40)
    assert first.block_ids == [7, 8, 9, 10, 11, 12, 13] and again.block_ids == [40, 41, 42, 43, 44, 45, 46]
    assert again.slot_mapping[0] == 40 * 16 and again.token_ids == first.token_ids
    assert side.build_connector_meta(step_output()).plans == []  # sent once per resumption
    _, params = side.request_finished(req, [])
    worker_reports(side, "r1")
    assert params["cachefuse"]["status"] == "fused" and params["cachefuse"]["preemptions"] == 1
    assert side.counters["requests_replanned_after_preemption"] == 1
    assert_no_state(side)


def test_a_running_request_listed_among_cached_ones_is_not_planned_again(make_side):
    side = make_side()
    req = request("r1")
    assert len(schedule(side, req)) == 1
    running = step_output()
    running.scheduled_cached_reqs = SimpleNamespace(req_ids=["r1"], resumed_req_ids=set(), new_block_ids=[None])
    assert side.build_connector_meta(running).plans == []  # decoding: only resumed requests are re-blended


def test_budget_defers_but_always_admits_one(make_side):
    side = make_side(max_blend_tokens_per_step=150)
    big, small, other = request("big", 400), request("small", 100), request("other", 100)
    assert side.get_num_new_matched_tokens(big, 0) == (399, False)  # over budget alone: admitted anyway
    assert side.get_num_new_matched_tokens(small, 0) == (None, False)  # deferred to a later step
    assert side.get_num_new_matched_tokens(big, 0) == (399, False)  # a re-call is not double counted
    side.build_connector_meta(step_output())  # the step ends: the budget resets
    assert side.get_num_new_matched_tokens(small, 0) == (99, False)
    assert side.get_num_new_matched_tokens(other, 0) == (None, False)  # 100 + 100 > 150
    side.build_connector_meta(step_output())
    fits = request("fits", 50, params={"cachefuse": {"chunks": [[0, 10], [10, 40]]}})
    assert side.get_num_new_matched_tokens(other, 0) == (99, False)
    assert side.get_num_new_matched_tokens(fits, 0) == (49, False)  # 100 + 50 == 150: an exact fit is admitted


def test_requests_without_fusion_and_malformed_ones(make_side):
    side = make_side()
    plain = request("plain", params={})
    assert side.get_num_new_matched_tokens(plain, 0) == (0, False)
    assert side.request_finished(plain, []) == (False, None)
    bad = request("bad", params={"cachefuse": {"chunks": [[0, 10], [5, 20]]}})
    assert side.get_num_new_matched_tokens(bad, 0) == (0, False)
    _, params = side.request_finished(bad, [])
    assert params["cachefuse"]["fallback_reason"] == "malformed_request"
    assert params["cachefuse"]["field"] == "cachefuse.chunks[1]"
    assert side.counters["fallback:malformed_request"] == 1
    stats = side.get_kv_connector_stats()
    assert stats.data == {"requests_fallback": 1, "fallback_malformed_request": 1}
    assert side.get_kv_connector_stats() is None  # reset after each interval
    assert_no_state(side)


def test_load_skipped_by_vllm_is_reported(make_side):
    side = make_side()
    req = request("r1")
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, blocks(100), 0)  # e.g. prompt_logprobs: vLLM loads nothing
    _, params = side.request_finished(req, [])
    assert params["cachefuse"]["fallback_reason"] == "load_skipped_by_vllm"
    assert_no_state(side)


def test_separator_fallback_segments_the_prompt(make_side):
    side = make_side(separator_token_id=50)
    req = request("sep", params={})  # no declared chunks: ids 3..102 contain 50 once
    assert side.get_num_new_matched_tokens(req, 0) == (99, False)
    assert side.planner.pending["sep"].request.chunks == ((0, 47),)


def test_worker_reports_drive_the_variant_index_and_the_plans(make_side):
    """Saves and evictions arrive in the worker's metadata; the next plan chooses from them by CFO."""
    from cachefuse.chunks import chunk_key
    from cachefuse.metadata.base import VariantRecord, record_to_dict

    side = make_side()
    req = request("r1")
    prompt = req.prompt_token_ids
    key_sys = chunk_key(prompt[0:10], side.key_context, at_prompt_start=True)  # the system chunk
    key_a = chunk_key(prompt[10:60], side.key_context)
    base = VariantRecord.without_stats(key_a, (), 50)
    after_x = VariantRecord(chunk_key=key_a, prefix=("x",), inter={"x": 9.0}, intra=1.0, num_tokens=50,
                            prefix_num_tokens={"x": 5}, ranked_tokens=(4, 2))
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=CacheFuseWorkerMeta(
        saved_variants=[record_to_dict(r) for r in (VariantRecord.without_stats(key_sys, (), 10), base, after_x)])))
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, blocks(100), 99)
    (plan,) = side.build_connector_meta(step_output(req)).plans
    assert [c.variant_id for c in plan.variants] == [make_id(key_sys), base.variant_id]  # a is first: exact base
    assert plan.variants[1].cfo == 0.0
    side.request_finished(req, [])
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=CacheFuseWorkerMeta(
        evicted_variants=[base.variant_id])))
    assert [r.variant_id for r in side.index.variants(key_a)] == [after_x.variant_id]
    req2 = request("r2")
    side.get_num_new_matched_tokens(req2, 0)
    side.update_state_after_alloc(req2, blocks(100), 99)
    (plan,) = side.build_connector_meta(step_output(req2)).plans
    assert plan.variants[1].variant_id == after_x.variant_id and plan.variants[1].ranked_tokens == (4, 2)
    assert plan.variants[1].cfo == pytest.approx(after_x.cci)  # x is not in the prompt: beta 0
    side.request_finished(req2, [])
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None))  # the step ends
    assert_no_state(side)


def measured(**bytes_per_s: float) -> dict:
    """The worker's figures: tiers' bandwidth; 100 us per row per layer; vLLM's own prefill 1 s per token
    (always slower than fusing: these tests are about the ratio and the rows)."""
    return {"tiers": bytes_per_s,
            "compute": {"fixed_s": 0.0, "per_row_s": 1e-4, "per_row_key_s": 0.0, "prefill_fixed_s": 0.0,
                        "prefill_per_token_s": 1.0, "prefill_per_token2_s": 0.0},
            "samples": {"blend_layers": 100, "prefill_steps": 10}}


def index_variants(side: SchedulerSide, *records: VariantRecord) -> None:
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=CacheFuseWorkerMeta(
        saved_variants=[record_to_dict(r) for r in records])))


def index_chunks(side: SchedulerSide, req) -> None:
    """Every declared chunk of `req` stored (its base variant indexed), so the controller's verdict stands
    alone: a declared chunk not stored is a hole, which a no-go fuses anyway to save (`save_holes`)."""
    prompt = req.prompt_token_ids
    index_variants(side, *(VariantRecord.without_stats(chunk_key(prompt[s:e], side.key_context, at_prompt_start=s == 0),
                                                       (), e - s)
                           for s, e in req.kv_transfer_params["cachefuse"]["chunks"]))


def planned_controller(side: SchedulerSide, req) -> tuple:
    """Schedules `req`; its plan and the controller's decision in its outcome."""
    (plan,) = schedule(side, req)
    _, params = side.request_finished(req, [])
    worker_reports(side, req.request_id)
    return plan, params["cachefuse"]["controller"]


def test_the_controller_prices_each_chunk_at_the_tier_the_index_knows(make_side):
    """Memory fast, disk slow. The prompt's chunks persist on disk (their records' home tier): r rises to
    hide the disk's load. Negative control: the same chunks at home in memory (a memory-only store) keep
    r_min, which is what pricing every chunk at the fastest measured tier said in both cases."""
    decisions = {}
    for home in ("memory", "disk"):
        side = make_side(ratio_mode="controller")
        req = request(f"r-{home}")  # system [0, 10), chunk [10, 60), 40 more tokens computed
        keys = (chunk_key(req.prompt_token_ids[0:10], side.key_context, at_prompt_start=True),
                chunk_key(req.prompt_token_ids[10:60], side.key_context))
        index_variants(side, *(VariantRecord.without_stats(k, (), n, tier=home)
                               for k, n in zip(keys, (10, 50), strict=True)))
        num_layers, bytes_per_token = side.gate.kv_geometry()
        assert num_layers == 4  # 2 full layers (cacheblend), 2 selective: r_min 29.6 ms, every row 38 ms
        side.figures = measured(memory=1e12, disk=60 * bytes_per_token / 0.034)  # the disk: 34 ms
        plan, decisions[home] = planned_controller(side, req)
        assert plan.recompute_ratio == decisions[home]["ratio"] and decisions[home]["fuse"]
        assert set(decisions[home]["est_load_by_tier_s"]) == {home} and decisions[home]["tier"] == home
    assert decisions["memory"]["ratio"] == 0.15 and "r_min" in decisions["memory"]["reason"]
    assert decisions["disk"]["ratio"] == pytest.approx(0.6) and "load-bound" in decisions["disk"]["reason"]
    assert decisions["disk"]["est_load_s"] == pytest.approx(0.034)


def test_the_controller_counts_the_rows_cachecraft_recomputes_by_cfo(make_side):
    """cachecraft recomputes ceil(CFO x tokens) of each chunk, CFO from the chosen variant: A is an exact
    base variant (CFO 0), B's only variant was computed after a chunk this prompt lacks."""
    side = make_side(ratio_mode="controller")
    req = request("cc", params={"cachefuse": {"chunks": [[0, 10], [10, 60], [60, 90]], "selector": "cachecraft"}})
    prompt = req.prompt_token_ids
    key_sys = chunk_key(prompt[0:10], side.key_context, at_prompt_start=True)
    key_a, key_b = chunk_key(prompt[10:60], side.key_context), chunk_key(prompt[60:90], side.key_context)
    after_x = VariantRecord(chunk_key=key_b, prefix=("x",), inter={"x": 0.02}, intra=1.0, num_tokens=30,
                            prefix_num_tokens={"x": 5})
    index_variants(side, VariantRecord.without_stats(key_sys, (), 10), VariantRecord.without_stats(key_a, (), 50),
                   after_x)
    side.figures = measured(disk=1e12)
    plan, decision = planned_controller(side, req)
    cfo_b = plan.variants[2].cfo
    assert plan.variants[1].cfo == 0.0 and 0.0 < cfo_b < 1.0
    assert decision["est_rows"] == math.ceil(cfo_b * 30) != math.ceil(0.15 * 80)  # not ratio x tokens
    assert decision["ratio"] == 0.15 and "no row depends on r" in decision["reason"]


def test_the_controller_prices_a_query_aware_probe_and_loads_first(make_side):
    """qcfuse probes the question through its critical layers over entries loaded whole: the decision
    prices the probe, adds the load to the compute and keeps r_min with depth 0 even on a slow disk,
    where cacheblend (the control) raises r to hide the load."""
    decisions = {}
    for selector in ("qcfuse", "cacheblend"):
        side = make_side(ratio_mode="controller")
        req = request(selector, params={"cachefuse": {"chunks": [[0, 10], [10, 60]], "selector": selector}})
        keys = (chunk_key(req.prompt_token_ids[0:10], side.key_context, at_prompt_start=True),
                chunk_key(req.prompt_token_ids[10:60], side.key_context))
        index_variants(side, *(VariantRecord.without_stats(k, (), n, tier="disk")
                               for k, n in zip(keys, (10, 50), strict=True)))
        _, bytes_per_token = side.gate.kv_geometry()
        side.figures = measured(disk=60 * bytes_per_token / 0.034)
        _, decisions[selector] = planned_controller(side, req)
    probed, control = decisions["qcfuse"], decisions["cacheblend"]
    assert probed["est_probe_s"] > 0 and probed["preload_depth"] == 0 and probed["ratio"] == 0.15
    assert probed["est_fused_s"] == pytest.approx(probed["est_load_s"] + probed["est_recompute_s"])
    assert control["est_probe_s"] == 0 and control["ratio"] > 0.15


def make_id(chunk_key: str) -> str:
    from cachefuse.metadata.base import make_variant_id

    return make_variant_id(chunk_key, ())


@pytest.fixture(scope="module")
def fuzz_side(tiny_model_dir, tmp_path_factory):
    path = tiny_model_dir("llama")
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model=str(path), dtype="float32", tokenizer=str(path), revision=None,
                                     hf_text_config=AutoConfig.from_pretrained(path)),
        cache_config=SimpleNamespace(block_size=16, enable_prefix_caching=False, prefix_caching_hash_algo="sha256",
                                     cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=2048, async_scheduling=False))
    config = CacheFuseConfig(store_dir=str(tmp_path_factory.mktemp("fuzz-store")), allow_debug_overrides=True)
    return SchedulerSide(vllm_config, config)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=kv_transfer_params)
def test_generated_params_never_escape_planning_and_leave_no_state(fuzz_side, params):
    """Planning runs inside vLLM's scheduler step: no input may raise out of it, every response says a
    documented status, and nothing is left behind once the request finishes."""
    side = fuzz_side
    req = SimpleNamespace(request_id="fuzz", prompt_token_ids=list(range(3, 103)), kv_transfer_params=params)
    matched, asynchronous = side.get_num_new_matched_tokens(req, 0)
    assert asynchronous is False and matched in (0, 99, None)
    if matched:
        schedule(side, req)
    side.build_connector_meta(step_output())  # the step ends: the budget resets
    _, outcome = side.request_finished(req, [])
    worker_reports(side, "fuzz" if matched else None)
    if outcome is not None:
        stats = outcome["cachefuse"]
        assert stats["status"] in ("fused", "fallback", "not_run"), stats
        assert len(str(stats)) < 2000
    assert_no_state(side)


def test_every_outcome_is_logged_once_at_debug(make_side, caplog):
    """Responses that cannot carry kv_transfer_params (stop strings, streaming) still leave a trace."""
    side = make_side()
    fused, malformed, decoding = request("r1"), request("r2", params={"cachefuse": {"chunks": "bad"}}), request("r3")
    with caplog.at_level(logging.DEBUG, logger="cachefuse.vllm.scheduler_side"):
        schedule(side, fused)
        side.request_finished(fused, [])  # one token: it finishes in the step of its blend, figures after
        worker_reports(side, "r1", chunks_hit=2)
        side.get_num_new_matched_tokens(malformed, 0)
        side.request_finished(malformed, [])
        schedule(side, decoding)
        worker_reports(side, "r3", chunks_hit=1)  # several tokens: the figures come first
        side.request_finished(decoding, [])
    lines = [r.getMessage() for r in caplog.records if "outcome" in r.getMessage()]
    assert len(lines) == 3
    assert "request r1 outcome {'status': 'fused', 'chunks_hit': 2}" in lines[0]
    assert "request r2 outcome {'status': 'fallback', 'fallback_reason': 'malformed_request'}" in lines[1]
    assert "request r3 outcome {'status': 'fused', 'chunks_hit': 1}" in lines[2]


def test_cachecraft_admission_plans_one_chunk_in_full_and_its_save_serves_the_replan(make_side):
    """Under `selector: cachecraft` the scheduler computes in full the one chunk whose base variant scores
    CFO 0.5 (the default admission policy). Two requests planned in the same step both admit it and the
    worker saves the same (chunk, prefix) twice: the index holds one variant for it, and a later request
    loads it at CFO 0. A request preempted after its admission replays its first plan (the chunk in full
    again, though its own save is now indexed): the K/V its first tokens came from. Negative control:
    `variant_admission_max_chunks: 0` loads the base variant at 0.5."""
    chunks = {"cachefuse": {"chunks": [[0, 10], [10, 60], [60, 90]]}}
    side = make_side(selector="cachecraft")
    first, second = request("r1", params=chunks), request("r2", params=chunks)
    prompt = first.prompt_token_ids
    key_sys = chunk_key(prompt[0:10], side.key_context, at_prompt_start=True)
    key_a, key_b = chunk_key(prompt[10:60], side.key_context), chunk_key(prompt[60:90], side.key_context)
    index_variants(side, *(VariantRecord.without_stats(k, (), n) for k, n in ((key_sys, 10), (key_a, 50), (key_b, 30))))
    for req in (first, second):
        side.get_num_new_matched_tokens(req, 0)
        side.update_state_after_alloc(req, blocks(100), 99)
    plans = side.build_connector_meta(step_output(first, second)).plans
    assert [[c and c.cfo for c in plan.variants] for plan in plans] == [[0.0, 0.0, None]] * 2
    after_a = VariantRecord(chunk_key=key_b, prefix=(key_a,), inter={key_a: 3.0}, intra=1.0, num_tokens=30,
                            prefix_num_tokens={key_a: 50}, ranked_tokens=(5, 1))
    index_variants(side, after_a, after_a)  # both workers' saves of b after (a) arrive
    assert [r.prefix for r in side.index.variants(key_b)] == [(), (key_a,)]
    for req in (first, second):
        side.request_finished(req, [])
    worker_reports(side, None)

    preempted = request("r3", params=chunks)
    side.index.remove(after_a.variant_id)
    (planned,) = schedule(side, preempted)
    assert planned.variants[2] is None  # admitted again: its variant is gone
    index_variants(side, after_a)  # the worker saved it; vLLM preempted r3 and now resumes it
    worker_reports(side, "r3")
    (resumed,) = schedule(side, preempted, resumed_first_block=40)
    assert resumed.replay and resumed.variants == planned.variants and resumed.variants[2] is None
    side.request_finished(preempted, [])
    worker_reports(side, "r3")
    assert_no_state(side)
    (later,) = schedule(side, request("r4", params=chunks))  # a new request loads the saved variant
    assert later.variants[2].variant_id == after_a.variant_id and later.variants[2].cfo == 0.0 and not later.replay
    side.request_finished(request("r4", params=chunks), [])
    worker_reports(side, "r4")
    assert_no_state(side)

    control = make_side(selector="cachecraft", variant_admission_max_chunks=0)
    index_variants(control, *(VariantRecord.without_stats(k, (), n)
                              for k, n in ((key_sys, 10), (key_a, 50), (key_b, 30))))
    (plan,) = schedule(control, request("c1", params=chunks))
    assert [c.cfo for c in plan.variants] == [0.0, 0.0, 0.5]


def test_store_variant_plans_the_last_chunk_in_full_and_admits_nothing_else(make_side):
    """`store_variant` (offline neighbour fusion): the last declared chunk is a hole although its base
    variant is stored, so the worker saves it for its prefix, and under cachecraft's admission no other
    chunk is computed. Negative control: without the field, admission computes the first candidate (c,
    CFO 0.5) and loads the last chunk."""
    side = make_side(selector="cachecraft")
    params = {"cachefuse": {"chunks": [[0, 10], [10, 40], [40, 60], [60, 90]], "selector": "full_reuse",
                            "recompute_ratio": 0.0}}
    prompt = request("p0", params=params).prompt_token_ids
    spans = ((0, 10), (10, 40), (40, 60), (60, 90))
    keys = [chunk_key(prompt[s:e], side.key_context, at_prompt_start=s == 0) for s, e in spans]
    index_variants(side, *(VariantRecord.without_stats(k, (), e - s) for k, (s, e) in zip(keys, spans, strict=True)))
    (plain,) = schedule(side, request("r0", params=params))
    assert [c and c.cfo for c in plain.variants] == [0.0, 0.0, None, 0.5]
    params["cachefuse"]["store_variant"] = True
    (stores,) = schedule(side, request("r1", params=params))
    assert [c and c.cfo for c in stores.variants] == [0.0, 0.0, 0.5, None]


def test_a_reload_while_the_writer_is_behind_keeps_what_the_worker_announced(make_side):
    """The worker announces holes at submit and writes them later (fsyncs, a metadata transaction); the
    index refresher's reload in between (another save bumped the generation) must not drop them, or the
    next request recomputes chunks it could load. Once written and seen by a reload, the snapshot rules."""
    side = make_side()
    req = request("r1")
    key_a = chunk_key(req.prompt_token_ids[10:60], side.key_context)
    queued = VariantRecord(chunk_key=key_a, prefix=("x",), inter={"x": 1.0}, intra=1.0, num_tokens=50,
                           prefix_num_tokens={"x": 5})
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=CacheFuseWorkerMeta(
        saved_keys=[queued.store_key], saved_variants=[record_to_dict(queued)])))
    with side._refresher._open() as metastore:  # another save lands: the generation moves, a reload follows
        metastore.put(VariantRecord.without_stats("elsewhere", (), 4))
        assert side._refresher.refresh_once(metastore)
        assert [r.variant_id for r in side.index.variants(key_a)] == [queued.variant_id]
        side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=CacheFuseWorkerMeta(
            written_keys=[queued.store_key])))
        metastore.put(VariantRecord.without_stats("more", (), 4))  # its row is not there: evicted meanwhile
        assert side._refresher.refresh_once(metastore) and side.index.variants(key_a) == []


def test_a_step_reports_the_later_of_an_eviction_and_a_save_of_one_variant():
    record = VariantRecord.without_stats("k" * 32, ("p",), 4)
    meta = CacheFuseWorkerMeta()
    meta.evict([record.variant_id])  # an earlier save failed ...
    meta.announce([record.store_key], [record_to_dict(record)])  # ... and the hole was saved again
    assert meta.evicted_variants == [] and meta.saved_keys == [record.store_key]
    meta.evict([record.variant_id])  # announced, then refused by the writer within the same step
    assert meta.saved_variants == [] and meta.saved_keys == [] and meta.evicted_variants == [record.variant_id]


def test_a_request_waiting_for_blocks_is_one_fallback(make_side, caplog):
    """vLLM asks about a waiting request every step until blocks free up: a malformed one asked 20 times is
    one request that fell back, in the counters, in the Prometheus stats and in the log."""
    side = make_side()
    bad = request("bad", params={"cachefuse": {"chunks": [[0, 10], [5, 20]]}})
    with caplog.at_level(logging.INFO, logger="cachefuse.vllm.scheduler_side"):
        for _ in range(20):
            assert side.get_num_new_matched_tokens(bad, 0) == (0, False)
            side.build_connector_meta(step_output())  # no blocks this step: asked again in the next
        side.request_finished(bad, [])
        worker_reports(side, None)
    assert (side.counters["requests_fallback"], side.counters["fallback:malformed_request"]) == (1, 1)
    assert side.get_kv_connector_stats().data == {"requests_fallback": 1, "fallback_malformed_request": 1}
    assert len([r for r in caplog.records if "runs as plain vLLM" in r.getMessage()]) == 1
    assert_no_state(side)


def test_a_preempted_fused_request_is_one_fused_request(make_side, caplog):
    """Blended, preempted, blended again on resumption: one request fused (counted by the scheduler for
    Prometheus, not per blend by the worker) and one outcome logged; the replan is an event, counted."""
    side = make_side(ratio_mode="fixed")  # the counters of a fixed-ratio engine: no controller decision counted
    req = request("r1")
    with caplog.at_level(logging.DEBUG, logger="cachefuse.vllm.scheduler_side"):
        schedule(side, req)
        worker_reports(side, "r1", chunks_hit=2)
        schedule(side, req, resumed_first_block=40)  # preempted, then resumed
        worker_reports(side, "r1", chunks_hit=2)
        _, params = side.request_finished(req, [])
        worker_reports(side, None)
    assert params["cachefuse"]["status"] == "fused" and params["cachefuse"]["preemptions"] == 1
    assert side.counters["requests_fused"] == 1 and side.counters["requests_replanned_after_preemption"] == 1
    assert side.get_kv_connector_stats().data == {"requests_fused": 1, "samples_recompute_ratio": [0.15]}  # once each
    assert len([r for r in caplog.records if "request r1 outcome" in r.getMessage()]) == 1
    assert_no_state(side)


def test_a_request_that_fell_back_then_was_planned_leaves_nothing_and_counts_as_fused(make_side):
    """vLLM's hook order for a request the controller first turned down (no_go: it runs as plain vLLM)
    and, once resumed after a preemption with other figures, plans and fuses: its earlier fallback must
    neither outlive it nor be counted, its response says fused."""
    side = make_side(ratio_mode="controller")
    req = request("r1")
    index_chunks(side, req)
    side.figures = {**measured(disk=1.0), "compute": {**measured()["compute"], "per_row_s": 1.0,
                                                      "prefill_per_token_s": 1e-9}}  # vLLM's prefill far faster
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, blocks(100), 0)
    assert side.build_connector_meta(step_output(req)).plans == []  # runs as plain vLLM ...
    side.figures = {}  # ... is preempted, and resumes with no figures: the fixed ratio, fused
    (plan,) = schedule(side, req, resumed_first_block=40)
    worker_reports(side, "r1")
    _, params = side.request_finished(req, [])
    worker_reports(side, None)
    assert params["cachefuse"]["status"] == "fused"
    assert_no_state(side)
    assert (side.counters["requests_fused"], side.counters["requests_fallback"]) == (1, 0)


def test_sync_save_from_a_client_runs_as_plain_vllm_unless_allowed(make_side):
    """`sync_save` holds the whole step for one request's writes: on a server's default config the request
    runs as plain vLLM, its response naming the field and the setting, and no plan asks the worker to
    write inline. Negative control: an offline engine's config (allow_sync_save) plans it with sync_save."""
    params = {"cachefuse": {"chunks": [[0, 10], [10, 60]], "sync_save": True}}
    server = make_side()
    client = request("client", params=params)
    assert server.get_num_new_matched_tokens(client, 0) == (0, False)
    _, response = server.request_finished(client, [])
    assert response["cachefuse"]["fallback_reason"] == "malformed_request"
    assert response["cachefuse"]["field"] == "cachefuse.sync_save"
    assert "allow_sync_save" in response["cachefuse"]["detail"]
    assert_no_state(server)
    (plan,) = schedule(make_side(allow_sync_save=True), request("precompute", params=params))
    assert plan.sync_save is True


def test_an_unexpected_planning_error_runs_the_request_as_plain_vllm(make_side, monkeypatch, caplog):
    """Planning raising (a bug, or a metadata row no check caught) must not stop vLLM's scheduler step:
    the request runs as plain vLLM and says why."""
    side = make_side()

    def broken(*args, **kwargs):
        raise ValueError("cannot convert float NaN to integer")

    monkeypatch.setattr(planning_module, "plan_variants", broken)
    req = request("r1")
    with caplog.at_level(logging.ERROR, logger="cachefuse.vllm.scheduler_side"):
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert "planning failed unexpectedly" in caplog.text
    _, params = side.request_finished(req, [])
    assert params["cachefuse"]["fallback_reason"] == "planning_error" and "ValueError" in params["cachefuse"]["detail"]
    assert side.counters["fallback:planning_error"] == 1
    assert_no_state(side)


def no_go_figures() -> dict:
    """Measured figures under which the controller turns every request down (vLLM's prefill far faster)."""
    return {**measured(disk=1.0), "compute": {**measured()["compute"], "per_row_s": 1.0, "prefill_per_token_s": 1e-9}}


def test_a_no_go_with_chunks_not_stored_fuses_to_save_them(make_side):
    """Under figures that turn every request down, a request whose chunk is not stored is fused anyway
    (verdict save_holes): plain vLLM would not save it, and every later request with it would price it as
    computed in full and be turned down again, so the cache would never fill from served requests.
    Negative controls: the same prompt with every chunk stored is a no-go (plain vLLM), and so is the
    request with holes when the engine does not save holes."""
    outcomes = {}
    for case in ("hole", "stored", "hole_not_saved"):
        side = make_side(ratio_mode="controller", save_holes=case != "hole_not_saved")
        req = request(f"r-{case}")  # system [0, 10), chunk [10, 60)
        if case == "stored":
            index_chunks(side, req)
        else:  # the system prompt stored, the chunk not
            index_variants(side, VariantRecord.without_stats(
                chunk_key(req.prompt_token_ids[0:10], side.key_context, at_prompt_start=True), (), 10))
        side.figures = no_go_figures()
        plans = schedule(side, req)
        _, params = side.request_finished(req, [])
        if plans:
            worker_reports(side, req.request_id)
        outcomes[case] = (len(plans), params["cachefuse"])
        assert_no_state(side)
    num_plans, hole = outcomes["hole"]
    assert num_plans == 1 and hole["status"] == "fused" and hole["controller"]["verdict"] == "save_holes"
    assert hole["controller"]["reason"].startswith("save holes: 1 declared chunk(s) of 50 tokens")
    assert "no-go:" in hole["controller"]["reason"]  # what the estimate said, kept
    for case in ("stored", "hole_not_saved"):
        num_plans, outcome = outcomes[case]
        assert num_plans == 0 and outcome["fallback_reason"] == "no_go", (case, outcome)


def test_the_controller_prices_plain_vllm_past_its_own_prefix_cache_hit(make_side):
    """vLLM asks with its prefix-cache hit (80 of 100 tokens): plain vLLM would compute 20, the blend all
    100 (it only skips writing the hit), so the request runs plain. Negative control: with no hit, the same
    request and figures fuse."""
    figures = {**measured(memory=1e12), "compute": {**measured()["compute"], "prefill_per_token_s": 5e-4}}
    outcomes = {}
    for hit in (0, 80):
        side = make_side(ratio_mode="controller")
        req = request(f"hit{hit}")
        index_chunks(side, req)
        side.figures = figures
        matched, _ = side.get_num_new_matched_tokens(req, hit)
        _, params = side.request_finished(req, [])
        outcomes[hit] = matched, params["cachefuse"]
    assert outcomes[0][0] == 99 and outcomes[0][1]["controller"]["verdict"] == "go"
    assert outcomes[80][0] == 0 and outcomes[80][1]["fallback_reason"] == "no_go"
    assert "its prefix cache holds 80 of 100 tokens" in outcomes[80][1]["detail"]


def test_a_preempted_fused_request_replays_its_first_plan(make_side):
    """Blended, preempted after its own holes were saved and indexed, resumed when the controller would say
    no-go: the resumed blend replays the first plan (the holes in full again, no controller), so vLLM decodes
    the rest over the K/V its first tokens came from. Planned afresh, the saved holes became hits and the
    rows went elsewhere (another answer), or the request fell back and was reported as plain vLLM although
    its first tokens were fused."""
    side = make_side(ratio_mode="controller")
    req = request("r1", params={"cachefuse": {"chunks": [[0, 10], [10, 60], [60, 90]]}})
    prompt = req.prompt_token_ids
    key_sys = chunk_key(prompt[0:10], side.key_context, at_prompt_start=True)
    key_a = chunk_key(prompt[10:60], side.key_context)
    index_variants(side, VariantRecord.without_stats(key_sys, (), 10), VariantRecord.without_stats(key_a, (), 50))
    side.figures = {}  # no figures yet: the fixed ratio, fused
    (first,) = schedule(side, req)
    assert first.variants[2] is None and not first.replay  # chunk b: a hole
    worker_reports(side, "r1", chunks_hit=2, miss_reasons={"not_stored": 1}, chunks_loaded=[True, True, False])
    key_b = chunk_key(prompt[60:90], side.key_context)
    index_variants(side, VariantRecord.without_stats(key_b, (key_a,), 30))  # its save of b, now indexed
    side.figures = no_go_figures()
    req.num_output_tokens = 7  # decoded 7 tokens over the fused K/V, then preempted
    for _ in range(3):  # resumed: vLLM asks again every step it waits for blocks, counted once
        assert side.get_num_new_matched_tokens(req, 0) == (99, False)
    (replayed,) = schedule(side, req, resumed_first_block=40)
    assert replayed.replay and replayed.variants == first.variants and replayed.recompute_ratio == first.recompute_ratio
    assert replayed.slot_mapping[0] == 40 * 16  # into its new blocks
    worker_reports(side, "r1", chunks_hit=2, miss_reasons={"not_stored": 1}, chunks_loaded=[True, True, False],
                   replay_exact=True)
    _, params = side.request_finished(req, [])
    outcome = params["cachefuse"]
    assert outcome["status"] == "fused" and outcome["preemptions"] == 1 and outcome["replay_exact"] is True
    assert side.counters["requests_fused"] == 1 and side.counters["requests_fallback"] == 0
    assert side.counters["requests_replanned_after_preemption"] == 1
    assert_no_state(side)

    # Negative control: a new request with the same prompt is planned afresh, b loaded, the controller asked.
    side.figures = {}
    (fresh,) = schedule(side, request("r2", params=req.kv_transfer_params))
    assert fresh.variants[2] is not None and not fresh.replay


def test_a_replay_recomputes_what_the_last_blend_did_not_load_and_one_that_fails_says_so(make_side):
    """The first blend missed chunk a (a load timeout; under TP another rank's miss): it computed a in
    full, so the replay must too, whatever the store holds now. The replay's figures arrive after vLLM
    freed the request (vLLM finishes a request before it hands over the step's worker output)."""
    side = make_side()
    req = request("r1")
    prompt = req.prompt_token_ids
    index_variants(side, VariantRecord.without_stats(chunk_key(prompt[0:10], side.key_context, at_prompt_start=True),
                                                     (), 10),
                   VariantRecord.without_stats(chunk_key(prompt[10:60], side.key_context), (), 50))
    (first,) = schedule(side, req)
    assert all(v is not None for v in first.variants)
    worker_reports(side, "r1", chunks_hit=1, chunks_loaded=[True, False], miss_reasons={"load_timeout": 1})
    (replayed,) = schedule(side, req, resumed_first_block=40)
    assert replayed.variants == [first.variants[0], None]
    _, params = side.request_finished(req, [])  # its last token came in the replay's step
    worker_reports(side, "r1", chunks_hit=1, chunks_loaded=[True, False], replay_exact=False)
    assert params["cachefuse"]["status"] == "fused" and params["cachefuse"]["replay_exact"] is False
    assert side.counters["requests_fused"] == 1

    failing = request("r2")
    schedule(side, failing)
    worker_reports(side, "r2", chunks_hit=2, chunks_loaded=[True, True])
    schedule(side, failing, resumed_first_block=40)
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=CacheFuseWorkerMeta(
        request_stats={"r2": {"status": "fallback", "fallback_reason": "blend_error", "detail": "boom"}})))
    failing.num_output_tokens = 4
    assert side.get_num_new_matched_tokens(failing, 0) == (0, False)  # preempted again: plain from here on
    side.update_state_after_alloc(failing, blocks(100, first=60), 0)  # vLLM admits it, loading nothing
    _, params = side.request_finished(failing, [])
    outcome = params["cachefuse"]
    assert outcome["status"] == "fallback" and outcome["fallback_reason"] == "blend_error"
    assert outcome["fused_before_preemption"] is True and outcome["preemptions"] == 2  # replayed, then plain
    worker_reports(side, None)
    assert_no_state(side)


def test_a_request_whose_blend_failed_or_that_fell_back_stays_plain_when_resumed(make_side):
    """Its first tokens came from plain K/V (vLLM recomputed it): blended on resumption, the rest would be
    decoded over fused K/V. A request that fell back before it produced a token may still be planned."""
    side = make_side(ratio_mode="controller", max_blend_tokens_per_step=150)
    failed = request("r1")
    side.figures = {}
    schedule(side, failed)
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=CacheFuseWorkerMeta(
        request_stats={"r1": {"status": "fallback", "fallback_reason": "blend_error", "detail": "boom"}})))
    assert side.get_num_new_matched_tokens(failed, 0) == (0, False)  # resumed: plain again
    side.update_state_after_alloc(failed, blocks(100, first=60), 0)  # vLLM admits it, loading nothing
    assert side.get_num_new_matched_tokens(request("next"), 0) == (99, False)  # it took no blend budget
    side.request_finished(request("next"), [])
    assert side.build_connector_meta(step_output(resumed=[failed])).plans == []

    turned_down = request("r2")
    index_chunks(side, turned_down)
    side.figures = no_go_figures()
    assert side.get_num_new_matched_tokens(turned_down, 0) == (0, False)
    turned_down.num_output_tokens = 3  # ran plain, preempted, resumes with figures that would fuse
    side.figures = {}
    assert side.get_num_new_matched_tokens(turned_down, 0) == (0, False)
    reasons = []
    for req in (failed, turned_down):
        _, params = side.request_finished(req, [])
        assert params["cachefuse"]["status"] == "fallback"
        reasons.append(params["cachefuse"]["fallback_reason"])
    assert reasons == ["blend_error", "no_go"]  # the reasons they ran plain for, not a skipped load
    worker_reports(side, None)
    assert_no_state(side)
    assert side.counters["requests_fallback"] == 2


def test_the_blocks_reported_on_a_failed_blend_cover_the_hit_only(make_side):
    """error_block_ids cover positions 0..N-2 (cachefuse's hit; vLLM computes N-1): with 97 tokens in blocks
    of 16, the seventh block holds only position 96 and is not reported (100 tokens cannot tell)."""
    side = make_side()
    req = request("r1", 97)
    (plan,) = schedule(side, req)
    assert len(plan.block_ids) == 7 and plan.error_block_ids == plan.block_ids[:-1]
    side.request_finished(req, [])
    worker_reports(side, "r1")
    assert_no_state(side)


def test_preemption_outcomes_under_vllms_hook_order(make_side):
    """Found by walking every lifecycle in vLLM's hook order: a replay that lost a chunk stays inexact after
    a later exact one; a request asked again after a preemption and then aborted never resumed; a request
    deferred by the blend budget and aborted says it never ran; a streaming-input session that grew its
    prompt in place replays only the prompt it blended (vLLM recomputes the later turns over it)."""
    side = make_side()
    req = request("r1")
    schedule(side, req)
    worker_reports(side, "r1", chunks_hit=2, chunks_loaded=[True, True])
    schedule(side, req, resumed_first_block=40)
    worker_reports(side, "r1", chunks_hit=1, chunks_loaded=[True, False], replay_exact=False)  # a chunk evicted
    schedule(side, req, resumed_first_block=60)
    worker_reports(side, "r1", chunks_hit=1, chunks_loaded=[True, False], replay_exact=True)
    _, params = side.request_finished(req, [])
    assert params["cachefuse"]["preemptions"] == 2 and params["cachefuse"]["replay_exact"] is False

    asked = request("r2")
    schedule(side, asked)
    worker_reports(side, "r2", chunks_hit=2, chunks_loaded=[True, True])
    assert side.get_num_new_matched_tokens(asked, 0) == (99, False)  # preempted, asked, never admitted
    _, params = side.request_finished(asked, [])  # aborted while waiting
    assert "preemptions" not in params["cachefuse"] and params["cachefuse"]["status"] == "fused"

    small = make_side(max_blend_tokens_per_step=150)
    first, deferred = request("big", 140), request("late", 100)
    assert small.get_num_new_matched_tokens(first, 0)[0] == 139
    assert small.get_num_new_matched_tokens(deferred, 0) == (None, False)
    _, params = small.request_finished(deferred, [])  # aborted before any step had room
    assert params["cachefuse"]["status"] == "not_run" and "max_blend_tokens_per_step" in params["cachefuse"]["detail"]
    small.request_finished(first, [])
    small.build_connector_meta(step_output())

    session = request("s1")
    (blended,) = schedule(side, session)
    worker_reports(side, "s1", chunks_hit=2, chunks_loaded=[True, True])
    session.prompt_token_ids = session.prompt_token_ids + list(range(500, 530))  # turn 2, grown in place
    session.num_output_tokens = 5
    assert side.get_num_new_matched_tokens(session, 0) == (99, False)  # the blended prompt, not 129
    (replayed,) = schedule(side, session, resumed_first_block=40)
    assert len(replayed.token_ids) == 100 and replayed.token_ids == blended.token_ids
    worker_reports(side, "s1", chunks_hit=2, chunks_loaded=[True, True], replay_exact=True)
    side.request_finished(session, [])
    worker_reports(side, None)
    for s in (side, small):
        assert_no_state(s)


def test_a_no_go_fuses_one_request_a_minute_to_measure_its_figures_again(make_side):
    """A tier's figure changes only when a blend reads it, and its first read seeds it outright: one slow
    read kept every request at no-go for good (the disk never read again). After FIGURE_STALE_S of
    load-bound no-gos one request fuses anyway; the rest stay plain. The blend's compute figures too change
    only when a blend runs: a recompute-bound no-go (blend compute measured slow: a busy machine, a first
    pass paying one-time costs) kept every request plain for good, until it too re-measured after
    FIGURE_STALE_S (before this, it never did)."""
    from cachefuse.loading.figures import FIGURE_STALE_S

    side = make_side(ratio_mode="controller")
    now = [0.0]
    side.gate.clock = lambda: now[0]
    prompt = request("x").prompt_token_ids
    keys = (chunk_key(prompt[0:10], side.key_context, at_prompt_start=True), chunk_key(prompt[10:60], side.key_context))
    index_variants(side, *(VariantRecord.without_stats(k, (), n, tier="disk") for k, n in zip(keys, (10, 50),
                                                                                                   strict=True)))
    slow_disk = {**measured(disk=1e3), "compute": {**measured()["compute"], "prefill_per_token_s": 1e-4}}

    def decision(req_id, figures):
        side.figures = figures
        req = request(req_id)
        matched, _ = side.get_num_new_matched_tokens(req, 0)
        side.update_state_after_alloc(req, blocks(100), matched)
        plans = side.build_connector_meta(step_output(req)).plans
        worker_reports(side, req_id if plans else None)
        _, params = side.request_finished(req, [])
        return bool(plans), params["cachefuse"]

    fused, outcome = decision("a", slow_disk)
    assert not fused and outcome["fallback_reason"] == "no_go"
    now[0] = FIGURE_STALE_S - 1
    assert not decision("b", slow_disk)[0]
    now[0] = FIGURE_STALE_S + 1
    req = request("c")
    assert side.get_num_new_matched_tokens(req, 0)[0] == 99  # picked to re-measure ...
    assert side.get_num_new_matched_tokens(req, 0)[0] == 99  # ... and still, asked again before blocks
    side.request_finished(req, [])  # (aborted while waiting: nothing kept)
    now[0] = 2 * FIGURE_STALE_S + 2
    fused, outcome = decision("c", slow_disk)
    assert fused and outcome["controller"]["reason"].startswith("re-measure")
    now[0] = 2 * FIGURE_STALE_S + 3
    assert not decision("d", slow_disk)[0]  # one request, then no-go again until the next interval
    recompute_bound = {**measured(disk=1e12), "compute": {**measured()["compute"], "per_row_s": 1.0,
                                                          "prefill_per_token_s": 1e-9}}
    now[0] = 10 * FIGURE_STALE_S
    fused, outcome = decision("e", recompute_bound)
    assert not fused and "recompute-bound" in outcome["detail"]
    now[0] = 11 * FIGURE_STALE_S - 1
    assert not decision("f", recompute_bound)[0]  # the disk's re-measure fused "c": its clock started at "e"
    now[0] = 11 * FIGURE_STALE_S
    fused, outcome = decision("g", recompute_bound)
    assert fused and outcome["controller"]["reason"].startswith("re-measure (recompute-bound no-go for 60 s")
    now[0] = 11 * FIGURE_STALE_S + 1
    assert not decision("h", recompute_bound)[0]  # one request, then no-go again
    assert_no_state(side)
    # Prometheus counts each finished request's verdict once: "c" twice (aborted, then fused), both re-measures
    counted = side.get_kv_connector_stats().data
    assert (counted.get("controller_no_go"), counted.get("controller_remeasure"), counted.get("controller_go")) == (
        6, 3, None), counted


def test_only_a_step_of_one_plain_prefill_times_vllms_prefill():
    """The prefill model is fitted per prompt (fixed + a n + b n^2): a batch of k prompts timed as one prompt
    of their summed tokens fitted b ~k times too small (long prompts' plain prefill underestimated)."""
    from cachefuse.vllm.scheduler_side.planning import _plain_prefill_tokens

    def output(*new, cached=()):
        return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new],
                               num_scheduled_tokens={r: 100 for r in (*new, *cached)})

    assert _plain_prefill_tokens(output("a"), [], set()) == 100
    assert _plain_prefill_tokens(output("a", "b"), [], set()) == 0  # a batch: no sample
    assert _plain_prefill_tokens(output("a", cached=("c",)), [], set()) == 0  # with a decode
    assert _plain_prefill_tokens(output("a"), ["a plan"], set()) == 0  # with a blend
    assert _plain_prefill_tokens(output("a"), [], {"a"}) == 0  # a blended request's last token


def test_requests_fused_from_another_tier_do_not_hold_off_a_re_measure(make_side):
    """The wait for a re-measure is per tier: requests whose chunks are in a fast tier keep fusing, and the
    disk's no-go still ends in one re-measured disk request (one timer for all had never fired there)."""
    from cachefuse.loading.figures import FIGURE_STALE_S

    side = make_side(ratio_mode="controller")
    now = [0.0]
    side.gate.clock = lambda: now[0]
    prompts = {"disk": list(range(3, 103)), "redis": list(range(300, 400))}  # redis: a fast shared tier
    for home, prompt in prompts.items():
        keys = (chunk_key(prompt[0:10], side.key_context, at_prompt_start=True),
                chunk_key(prompt[10:60], side.key_context))
        index_variants(side, *(VariantRecord.without_stats(k, (), n, tier=home)
                               for k, n in zip(keys, (10, 50), strict=True)))
    side.figures = measured(redis=1e12, disk=1e2)  # the disk's load outlasts even vLLM's 1 s a token
    fused = []
    for i in range(8):
        now[0] = i * FIGURE_STALE_S / 3
        for home, prompt in prompts.items():
            req = SimpleNamespace(request_id=f"{home}{i}", prompt_token_ids=prompt,
                                  kv_transfer_params={"cachefuse": {"chunks": [[0, 10], [10, 60]]}})
            plans = schedule(side, req)
            worker_reports(side, req.request_id if plans else None)
            side.request_finished(req, [])
            fused.append((home, bool(plans)))
    assert all(ok for home, ok in fused if home == "redis")
    assert [i for i, (home, ok) in enumerate(fused) if home == "disk" and ok] == [6, 12]  # at 60 s, 120 s
    assert_no_state(side)


def test_async_loads_are_planned_at_allocation_and_the_post_load_allocation_changes_nothing(make_side):
    side = make_side(blend_step_tokens=1)  # below any blend: asynchronous
    req = request("a")
    assert side.get_num_new_matched_tokens(req, 0) == (99, True)
    # vLLM allocates blocks for the 99 loaded tokens only: position 99 gets its slot when vLLM computes it
    side.update_state_after_alloc(req, blocks(99), 99)
    meta = side.build_connector_meta(SimpleNamespace(  # the request waits: not among the scheduled
        scheduled_new_reqs=[], scheduled_cached_reqs=step_output().scheduled_cached_reqs,
        num_scheduled_tokens={}, finished_req_ids={"gone"}))
    [plan] = meta.plans
    assert plan.load_async and plan.req_id == "a" and meta.finished_req_ids == ["gone"]
    assert plan.slot_mapping[:2] == [7 * 16, 7 * 16 + 1] and len(plan.slot_mapping) == 100  # 7 blocks hold 112
    worker_reports(side, "a", chunks_hit=2)
    # the blend is done: vLLM schedules the last token, allocating again with no external tokens
    side.update_state_after_alloc(req, blocks(100), 0)
    assert side.planner.pending["a"].sent and side.planner.pending["a"].outcome.status != "fallback"
    params = side.request_finished(req, [])[1]
    assert params["cachefuse"]["status"] == "fused"
    assert_no_state(side)


def test_async_blocks_that_stop_before_the_last_token_give_it_no_slot(make_side):
    side = make_side(blend_step_tokens=1)  # below any blend: asynchronous
    req = request("a", num_tokens=97)  # 96 loaded tokens fill 6 blocks exactly
    assert side.get_num_new_matched_tokens(req, 0) == (96, True)
    side.update_state_after_alloc(req, blocks(96), 96)
    [plan] = side.build_connector_meta(step_output()).plans
    assert len(plan.slot_mapping) == 96 and plan.slot_mapping[-1] == 12 * 16 + 15  # position 96 has none yet


def test_a_failed_async_blend_runs_plain_when_vllm_asks_again(make_side):
    side = make_side(blend_step_tokens=1)  # below any blend: asynchronous
    req = request("a")
    assert side.get_num_new_matched_tokens(req, 0) == (99, True)
    side.update_state_after_alloc(req, blocks(99), 99)
    assert side.build_connector_meta(step_output()).plans
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=CacheFuseWorkerMeta(request_stats={
        "a": {"status": "fallback", "fallback_reason": "blend_error", "detail": "boom"}})))
    # vLLM (failed_recving, recompute policy) resets the request to 0 computed tokens and asks again
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    params = side.request_finished(req, [])[1]
    assert params["cachefuse"]["fallback_reason"] == "blend_error"
    assert_no_state(side)


def test_a_blend_that_fits_by_rows_but_not_by_its_measured_cost_runs_asynchronously(make_side):
    """The step's budget prices a pass by the worker's measured figures: a selective layer of few rows still
    costs its fixed work over every token. Negative control: the same request without figures (rows) runs
    synchronously, as does one under figures of rows alone."""
    # system [0, 10) and chunk [10, 60) stored, 40 rows computed: 2 full layers of 100 rows (cacheblend)
    # and 2 of 40 + 15% of 50 = 47.5 rows: 295 rows, within the 75-token budget (300 rows)
    rows_only = {"fixed_s": 0.0, "per_row_s": 1e-4, "per_row_key_s": 0.0}
    fixed = {"fixed_s": 5e-3, "per_row_s": 1e-4, "per_row_key_s": 1e-7}  # a 47.5-row layer: 64 rows' cost
    for compute, synchronous in ((None, True), (rows_only, True), (fixed, False)):
        side = make_side(blend_step_tokens=75)
        req = request("a")
        index_chunks(side, req)
        if compute is not None:
            side.figures = {**measured(), "compute": {**measured()["compute"], **compute}}
        assert side.get_num_new_matched_tokens(req, 0) == (99, not synchronous), compute
        assert side.planner.pending["a"].estimated_rows == pytest.approx(295 if synchronous else 327.8, abs=0.1)


def test_a_blend_runs_synchronously_when_it_fits_the_step_and_nothing_older_waits(make_side):
    """The first token one step sooner where the step has room: synchronous while this step's synchronous
    blends fit its budget and no asynchronous blend is waiting; asynchronous after (oldest first)."""
    # nothing indexed: each 100-token blend computes every row of the 4-layer model, 400 rows; budget 600
    side = make_side(blend_step_tokens=150)
    first, second, third = request("a"), request("b"), request("c")
    assert side.get_num_new_matched_tokens(first, 0) == (99, False)  # fits, nothing waits: synchronous
    assert side.get_num_new_matched_tokens(second, 0) == (99, True)  # the step's budget is spent
    side.update_state_after_alloc(first, blocks(100), 99)
    side.update_state_after_alloc(second, blocks(99), 99)
    plans = side.build_connector_meta(step_output(first)).plans
    assert [(p.req_id, p.load_async) for p in plans] == [("a", False), ("b", True)]
    # a new step: b's blend still runs, so c waits behind it although it would fit
    assert side.get_num_new_matched_tokens(third, 0) == (99, True)
    side.update_state_after_alloc(third, blocks(99), 99)
    assert [p.req_id for p in side.build_connector_meta(step_output()).plans] == ["c"]
    worker_reports(side, "a")
    worker_reports(side, "b")
    assert side.get_num_new_matched_tokens(request("d"), 0) == (99, True)  # c still runs
    side.request_finished(request("d"), [])  # d aborted before it was scheduled
    worker_reports(side, "c")
    # b's and c's blends ended, their first tokens not yet scheduled: vLLM computes them in the next step,
    # which a synchronous blend would make wait (it runs before the step's forward)
    assert side.get_num_new_matched_tokens(request("e0"), 0) == (99, True)
    side.request_finished(request("e0"), [])
    meta = side.build_connector_meta(step_output(first_tokens=("b", "c")))  # the step of their first tokens
    assert meta.first_tokens == 2  # the worker holds its waiting blends for this step
    assert side.get_num_new_matched_tokens(request("e"), 0) == (99, False)  # nothing waits: synchronous again
    side.update_state_after_alloc(request("e"), blocks(100), 99)
    assert side.build_connector_meta(step_output(request("e"), first_tokens=("b", "c"))).first_tokens == 0  # once


def test_vllms_own_prefix_hit_stays_vllms_and_the_blend_holds_the_rest(make_side):
    """With prefix caching on, vLLM asks with its own block-aligned hit: the blend holds [hit, N-1), its plan
    says what it must not write, and a failure reports only the blocks past the hit (the hit's are shared)."""
    side = make_side()
    req = request("r1", 100)
    assert side.get_num_new_matched_tokens(req, 32) == (100 - 1 - 32, False)
    side.update_state_after_alloc(req, blocks(100), 67)
    (plan,) = side.build_connector_meta(step_output(req)).plans
    assert plan.cached_prefix_tokens == 32 and len(plan.slot_mapping) == 100  # the pass still sees every position
    assert plan.error_block_ids == plan.block_ids[2:]  # positions 32..98
    worker_reports(side, "r1", chunks_hit=2)
    assert side.request_finished(req, [])[1]["cachefuse"]["status"] == "fused"
    assert_no_state(side)


def test_a_prompt_vllm_holds_whole_runs_plain_and_says_so(make_side):
    side = make_side()
    req = request("r1", 100)
    assert side.get_num_new_matched_tokens(req, 99) == (0, False)
    side.update_state_after_alloc(req, blocks(100), 0)
    params = side.request_finished(req, [])[1]["cachefuse"]
    assert params["status"] == "fallback" and params["fallback_reason"] == "local_prefix_hit"
    assert_no_state(side)


def test_a_resumed_request_that_finds_its_own_blocks_resumes_over_them(make_side):
    """Preempted after its blend, resumed: vLLM's cache still holds its (salted) blocks, covering everything the
    blend wrote: nothing is blended again, it stays fused and counts one resumption, exact."""
    side = make_side()
    req = request("r1", 100)
    schedule(side, req)
    worker_reports(side, "r1", chunks_hit=2, chunks_loaded=[True, True])
    assert side.get_num_new_matched_tokens(req, 112) == (0, False)  # prompt and some decoded tokens, its own
    side.update_state_after_alloc(req, blocks(120, first=40), 0)
    assert side.build_connector_meta(step_output(resumed=[req])).plans == []
    params = side.request_finished(req, [])[1]["cachefuse"]
    assert params["status"] == "fused" and params["preemptions"] == 1 and params["replay_exact"] is True
    assert_no_state(side)


def test_under_async_scheduling_every_blend_is_an_asynchronous_load(make_side):
    """vLLM learns an asynchronous load's failure before it schedules the request; a synchronous one's after it
    scheduled the next step, which vLLM 0.32 cannot recover from (tests/vllm/test_async_scheduling.py)."""
    side = make_side()  # blend_step_tokens 0: synchronous, but for async scheduling
    assert side.get_num_new_matched_tokens(request("sync"), 0) == (99, False)
    side.planner.async_scheduling = True
    assert side.get_num_new_matched_tokens(request("async"), 0) == (99, True)


def test_vllms_null_block_is_never_reported_as_a_load_error(make_side):
    """A sliding-window model's blocks out of every window are vLLM's shared null block (id 0): a failed
    blend must not report it (every request holding it would be recomputed, or worse)."""
    side = make_side()
    req = request("r1", 100)
    matched, _ = side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([0, 0, 9, 10, 11, 12, 13],)), matched)
    (plan,) = side.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="r1", block_ids=([0, 0, 9, 10, 11, 12, 13],))],
        scheduled_cached_reqs=step_output().scheduled_cached_reqs)).plans
    assert plan.error_block_ids == [9, 10, 11, 12, 13]

"""Preemption: vLLM frees a running fused request's blocks and resumes it later; the connector must
write its prompt's K/V again before vLLM recomputes the rest, or vLLM decodes over blocks nothing wrote.

A KV cache of 1,024 tokens holds two of these requests (~200 prompt + 150 generated tokens each), so a
batch of six preempts. Every request is checked against the same request run alone (no preemption):
at ratio 1.0 against plain vLLM, at 15% (cacheblend, and the query-aware fusionrag and qcfuse, whose
question probe runs again when the request is re-blended) against the unpreempted fused run. Each output's
`preemptions` shows which requests were resumed; the test insists some were, or it proves nothing.
"""

from __future__ import annotations

import pytest

from tests.helpers import vllm_engines as engines

SMALL_KV_CACHE = dict(kv_cache_memory_bytes=2 << 20, max_model_len=512)  # 1,024 tokens of the tiny llama
MAX_TOKENS = 150
ORDERS = [("system", "a", "b", "c", "question"), ("system", "c", "a", "d", "question"),
          ("system", "d", "b", "a", "question"), ("system", "b", "c", "d", "question"),
          ("system", "a", "d", "c", "question"), ("system", "c", "b", "a", "question")]


@pytest.fixture(scope="module")
def family():  # the scheduling path is model-independent
    return "llama"


@pytest.fixture(scope="module", params=[False, True], ids=["vllm_defaults_off", "prefix_caching_async_scheduling"])
def setup(request, tiny_model_dir, tmp_path_factory):
    """Prefix caching and async scheduling off, and both on (vLLM's defaults on a GPU): there a resumed
    request finds its own blended blocks in vLLM's cache (hashed apart from everyone else's) and resumes
    over them, and every blend is an asynchronous load."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # it overrides kv_cache_memory_bytes (whole GiB)
        store = tmp_path_factory.mktemp("preempt-store")
        llm = engines.start_engine(tiny_model_dir("llama"), store,
                                   {**SMALL_KV_CACHE, "enable_prefix_caching": request.param},
                                   async_scheduling=request.param)
    pieces = engines.random_pieces(5, {"system": 20, "a": 60, "b": 50, "c": 40, "d": 45, "question": 10})
    engines.precompute(llm, pieces["system"], [pieces[name] for name in "abcd"])
    yield llm, pieces
    engines.stop_engine(llm)


def one_at_a_time(llm, prompts, params):
    return [engines.generate(llm, [ids], [p], MAX_TOKENS)[0] for ids, p in zip(prompts, params, strict=True)]


@pytest.mark.parametrize(("selector", "ratio", "reference"), [
    ("cacheblend", 1.0, "plain"),
    ("cacheblend", 0.15, "fused alone"),
    ("fusionrag", 0.15, "fused alone"),  # query-aware: the probe runs again on the resumed request
    ("qcfuse", 0.15, "fused alone"),
])
def test_preempted_fused_requests_give_the_unpreempted_output(request, setup, selector, ratio, reference):
    if "prefix_caching_async_scheduling" in request.node.callspec.id and selector != "cacheblend":
        pytest.skip("the probe's second run does not depend on the scheduler: run with vLLM's defaults off only")
    llm, pieces = setup
    prompts, params = [], []
    for order in ORDERS:
        ids, p = engines.named_prompt(pieces, order, selector=selector, recompute_ratio=ratio)
        prompts.append(ids)
        params.append(p)
    counters = engines.scheduler_connector(llm).counters
    before = counters["requests_replanned_after_preemption"]
    batch = engines.generate(llm, prompts, params, MAX_TOKENS)  # preempts: the cache holds two of these
    resumed = counters["requests_replanned_after_preemption"] - before
    expected = one_at_a_time(llm, prompts, [None] * len(prompts) if reference == "plain" else params)
    assert resumed > 0, "no request was preempted: the KV cache is too large for this test"
    preempted = [o.kv_transfer_params["cachefuse"].get("preemptions", 0) for o in batch]
    assert sum(preempted) == resumed
    for output, want, times in zip(batch, expected, preempted, strict=True):
        stats = output.kv_transfer_params["cachefuse"]
        assert stats["status"] == "fused" and stats["chunks_hit"] == 4, stats
        assert output.outputs[0].token_ids == want.outputs[0].token_ids, f"preempted {times} time(s)"

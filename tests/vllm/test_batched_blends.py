"""Blends batched across a step's requests and split across engine steps, under vLLM's own scheduler.

The engine's budget (`blend_step_tokens` 48: a few layers of one request per step) splits every blend,
and requests sent together are batched. Each request of a batch gets the first-token logprobs and greedy
tokens it gets blended alone; at ratio 1.0 the output of plain vLLM. Negative control: a batched paged
attention that reads every request's rows through the first request's blocks. In the middle of a split
blend: an abort frees the request's blocks and stops its pass (pins released, nothing left running), an
exception in the pass falls back to plain vLLM's output, and a store that fails mid-pass leaves the
chunk a hole (the pass re-run, serially); the next requests are served as before each time.
"""

from __future__ import annotations

import pytest

from cachefuse.errors import StoreError
from cachefuse.fusion.batch import PassBatch
from cachefuse.vllm.paged import PagedAttention
from tests.helpers import vllm_engines as engines

BUDGET_TOKENS = 48
MAX_TOKENS = 6
ORDERS = [("system", "a", "b", "c", "question"), ("system", "c", "a", "d", "question"),
          ("system", "d", "b", "a", "question"), ("system", "b", "c", "d", "question")]


@pytest.fixture(scope="module")
def family():  # the scheduling path is model-independent
    return "llama"


@pytest.fixture(autouse=True)
def one_cohort(monkeypatch):
    """Every blend estimated at one row: the requests sent together start as one cohort, and the budget
    (a few layers of one request) splits it across steps, so each test batches and splits at once."""
    real_add = PassBatch.add
    monkeypatch.setattr(PassBatch, "add", lambda self, job_id, steps, estimated_rows=0.0: real_add(
        self, job_id, steps, 1.0))


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("batched-store")
    # layers read on the loader thread as the pass goes (preload_depth 2), so a pass paused between steps
    # holds a loader, and a store can fail in the middle of it
    llm = engines.start_engine(tiny_model_dir("llama"), store, blend_step_tokens=BUDGET_TOKENS, preload_depth=2)
    pieces = engines.random_pieces(7, {"system": 20, "a": 60, "b": 50, "c": 40, "d": 45, "question": 10})
    engines.precompute(llm, pieces["system"], [pieces[name] for name in "abcd"])
    yield llm, pieces
    engines.stop_engine(llm)


def prompts(pieces, **overrides):
    made = [engines.named_prompt(pieces, order, **overrides) for order in ORDERS]
    return [ids for ids, _ in made], [p for _, p in made]


def alone(llm, ids, params):
    return [engines.generate(llm, [i], [p], MAX_TOKENS)[0] for i, p in zip(ids, params, strict=True)]


def stats_of(output) -> dict:
    return output.kv_transfer_params["cachefuse"]


def assert_same_outputs(batch, expected, tol=1e-4) -> None:
    for output, want in zip(batch, expected, strict=True):
        assert engines.max_logprob_diff(engines.first_logprobs(want), engines.first_logprobs(output)) < tol
        assert output.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize("selector", ["cacheblend", "fusionrag"])
def test_each_request_of_a_batched_split_blend_gets_its_output_alone(setup, selector):
    llm, pieces = setup
    ids, params = prompts(pieces, selector=selector, recompute_ratio=0.15)
    expected = alone(llm, ids, params)
    assert all(stats_of(o)["blend_batch_size"] == 1 for o in expected)
    samples = engines.worker_side().figures.blend_samples
    samples.clear()
    batch = engines.generate(llm, ids, params, MAX_TOKENS)
    stats = [stats_of(o) for o in batch]
    assert all(s["status"] == "fused" and s["chunks_hit"] == 4 for s in stats), stats
    assert max(s["blend_batch_size"] for s in stats) > 1, "nothing was batched: the test proves nothing"
    # (a blend that fits the step's budget with nothing older waiting runs whole, synchronously)
    assert max(s["blend_steps"] for s in stats) > 1, "no blend was split across steps: the test proves nothing"
    assert_same_outputs(batch, expected)
    # The controller's compute samples: a batched pass's layer time is the batch's, never one request's
    # speed (under load it would read as a slow blend and turn requests down); a pass alone, split or not,
    # is timed only while it computes (4 layers each)
    assert len(samples) == 4 * sum(s["blend_batch_size"] == 1 for s in stats), (len(samples), stats)


def test_ratio_one_batched_and_split_equals_plain_vllm(setup):
    llm, pieces = setup
    ids, params = prompts(pieces, recompute_ratio=1.0)
    plain = engines.generate(llm, ids, [None] * len(ids), MAX_TOKENS)
    batch = engines.generate(llm, ids, params, MAX_TOKENS)
    assert max(stats_of(o)["blend_batch_size"] for o in batch) > 1
    assert_same_outputs(batch, plain, tol=1e-5)


def test_negative_control_rows_that_read_another_requests_blocks_change_its_output(setup, monkeypatch):
    llm, pieces = setup
    ids, params = prompts(pieces, recompute_ratio=0.15)
    expected = alone(llm, ids, params)
    real = PagedAttention.attend_many

    def leaky(attends):  # every request's rows read through the first request's block table
        first = attends[0].backend
        for op in attends[1:]:
            op.backend.block_table = first.block_table
        return real(attends)

    monkeypatch.setattr(PagedAttention, "attend_many", staticmethod(leaky))
    batch = engines.generate(llm, ids, params, MAX_TOKENS)
    monkeypatch.undo()
    batched = [i for i, o in enumerate(batch) if stats_of(o)["blend_batch_size"] > 1]
    assert len(batched) > 1
    diffs = [engines.max_logprob_diff(engines.first_logprobs(expected[i]), engines.first_logprobs(batch[i]))
             for i in batched]
    assert max(diffs) > 1e-3


def _add(llm, request_id, ids, params) -> str:
    """Adds a request; returns the id the engine core (and the connector) know it by."""
    from vllm import SamplingParams

    return llm.llm_engine.add_request(request_id, {"prompt_token_ids": ids}, SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, extra_args={"kv_transfer_params": params}))


def _free_blocks(llm) -> int:
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def test_an_abort_mid_split_blend_frees_its_blocks_and_stops_its_pass(setup):
    llm, pieces = setup
    ids, params = prompts(pieces, recompute_ratio=0.15)
    expected = alone(llm, ids[:2], params[:2])
    worker = engines.worker_side()
    free_before = _free_blocks(llm)
    aborted = _add(llm, "abort-me", ids[0], params[0])
    _add(llm, "keep-me", ids[1], params[1])
    llm.llm_engine.step()  # admits both (asynchronous loads) and runs the budget's first layers
    assert aborted in worker.passes and worker.passes.jobs[0].op is not None, (
        worker._running, worker.passes.jobs)  # mid-pass: started, not finished
    llm.llm_engine.abort_request(["abort-me"])
    finished = {}
    while llm.llm_engine.has_unfinished_requests():
        for output in llm.llm_engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert set(finished) == {"keep-me"}
    assert finished["keep-me"].outputs[0].token_ids == expected[1].outputs[0].token_ids
    assert not worker._running and not len(worker.passes)
    assert _free_blocks(llm) == free_before  # vLLM freed the aborted request's blocks once reported
    store = worker.engine.store
    assert not [key for key in store.keys() if key in getattr(store, "_pins", ())]
    assert_same_outputs(engines.generate(llm, ids[:1], params[:1], MAX_TOKENS), expected[:1])


def test_an_exception_mid_split_blend_falls_back_to_plain_vllm(setup, monkeypatch):
    llm, pieces = setup
    ids, params = prompts(pieces, recompute_ratio=0.15)
    plain = engines.generate(llm, ids[:2], [None, None], MAX_TOKENS)
    expected = alone(llm, ids[:2], params[:2])
    worker = engines.worker_side()
    real = worker.engine.fusor.execute_ops
    seen = {"layers": 0}

    def failing(ops):
        if type(ops[0]).__name__ == "Project":
            seen["layers"] += 1
            if seen["layers"] == 3:  # the third layer: after the first step's budget
                raise RuntimeError("injected mid-pass failure")
        return real(ops)

    monkeypatch.setattr(worker.passes, "execute", failing)
    batch = engines.generate(llm, ids[:2], params[:2], MAX_TOKENS)
    monkeypatch.undo()
    for output, want in zip(batch, plain, strict=True):
        stats = stats_of(output)
        assert stats["status"] == "fallback" and stats["fallback_reason"] == "blend_error", stats
        assert "injected mid-pass failure" in stats["detail"]
        assert engines.max_logprob_diff(engines.first_logprobs(want), engines.first_logprobs(output)) < 1e-5
    assert not worker._running and not len(worker.passes)
    assert_same_outputs(engines.generate(llm, ids[:2], params[:2], MAX_TOKENS), expected)


@pytest.mark.parametrize("failure", ["miss", "raises"])
def test_a_store_that_fails_mid_split_blend(setup, monkeypatch, failure):
    """A layer the store no longer has (evicted, corrupt: `get_layer` says None) makes the pass re-run
    with that chunk as a hole; a store that raises fails the blend, and vLLM computes the request plain."""
    llm, pieces = setup
    ids, params = prompts(pieces, recompute_ratio=0.15)  # read layer by layer (preload_depth 2): fails mid-pass
    plain = engines.generate(llm, ids[:2], [None, None], MAX_TOKENS)
    worker = engines.worker_side()
    store = worker.engine.store
    real_get_layer = store.get_layer
    failing_key = []

    def get_layer(key, layer):
        if layer >= 2 and (not failing_key or failing_key[0] == key):
            failing_key[:1] = [key]  # the first key read at layer 2 fails from now on
            if failure == "raises":
                raise StoreError("injected: the store went away mid-pass")
            return None
        return real_get_layer(key, layer)

    monkeypatch.setattr(store, "get_layer", get_layer)
    batch = engines.generate(llm, ids[:2], params[:2], MAX_TOKENS)
    monkeypatch.undo()
    stats = [stats_of(o) for o in batch]
    if failure == "miss":
        assert all(s["status"] == "fused" for s in stats), stats
        assert sum(s["chunks_missed"] for s in stats) >= 1 and any(s["miss_reasons"] for s in stats), stats
    else:
        assert any(s["status"] == "fallback" and "injected" in s["detail"] for s in stats), stats
        for output, want, s in zip(batch, plain, stats, strict=True):
            if s["status"] == "fallback":
                assert engines.max_logprob_diff(engines.first_logprobs(want), engines.first_logprobs(output)) < 1e-5
    assert not worker._running and not len(worker.passes)
    again = [stats_of(o) for o in engines.generate(llm, ids[:2], params[:2], MAX_TOKENS)]
    assert all(s["status"] == "fused" and s["chunks_missed"] == 0 for s in again), again

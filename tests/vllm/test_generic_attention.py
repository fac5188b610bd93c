"""The worker's generic attention path (the one a GPU backend takes) equals vLLM's paged CPU kernel.

On vLLM's CPU backend the blend pass attends with the engine's own paged kernel and writes each layer's
merged K/V into the cache as it goes (cachefuse.vllm.paged). Under any other backend it takes the
generic path (SlotWritingAttention): each layer's merged K/V written through `do_kv_cache_update` as it
attends with the torch twins (the Triton kernels on CUDA) over them. Forced here on the CPU, the two paths must give the same
first-token logprobs and greedy tokens for the same fused request, at 15% and with a hole; the
negative control is full reuse, which differs.
"""

from __future__ import annotations

import pytest

from tests.helpers.tolerances import LOGPROB_TOL
from tests.helpers.vllm_engines import (
    first_logprobs,
    generate,
    max_logprob_diff,
    named_prompt,
    precompute,
    random_pieces,
    start_engine,
    stop_engine,
    worker_side,
)

pytestmark = pytest.mark.vllm
LENGTHS = {"system": 12, "a": 33, "b": 27, "c": 41, "question": 9}


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    """A store with system, a and c; served by an engine that saves no holes, so b stays a hole and
    every run of a prompt sees the same store."""
    store = tmp_path_factory.mktemp("generic-store")
    pieces = random_pieces(21, LENGTHS)
    writer = start_engine(tiny_model_dir("llama"), store)
    precompute(writer, pieces["system"], [pieces["a"], pieces["c"]])
    stop_engine(writer)
    llm = start_engine(tiny_model_dir("llama"), store, save_holes=False)
    yield llm, pieces
    stop_engine(llm)


def _run(llm, prompt, params, paged: bool):
    worker = worker_side()
    worker.paged_attention = paged
    try:
        out = generate(llm, [prompt], [params], max_tokens=4)[0]
    finally:
        worker.paged_attention = None  # decided again at the next blend
    assert out.kv_transfer_params["cachefuse"]["status"] == "fused", out.kv_transfer_params
    return first_logprobs(out), list(out.outputs[0].token_ids)


@pytest.mark.parametrize("selector,ratio", [("cacheblend", 0.15), ("epic", 0.3), ("full_prefill", 1.0)])
def test_generic_path_equals_paged_kernel(engine, selector, ratio):
    llm, pieces = engine
    prompt, params = named_prompt(pieces, ["system", "c", "b", "a", "question"], selector=selector,
                                  recompute_ratio=ratio)
    paged_lp, paged_tokens = _run(llm, prompt, params, paged=True)
    generic_lp, generic_tokens = _run(llm, prompt, params, paged=False)
    assert max_logprob_diff(paged_lp, generic_lp) <= LOGPROB_TOL
    assert generic_tokens == paged_tokens


def test_negative_control_full_reuse_differs(engine):
    llm, pieces = engine
    prompt, params = named_prompt(pieces, ["system", "c", "b", "a", "question"], selector="cacheblend",
                                  recompute_ratio=0.15)
    reuse_params = {"cachefuse": {**params["cachefuse"], "selector": "full_reuse"}}
    generic_lp, _ = _run(llm, prompt, params, paged=False)
    reuse_lp, _ = _run(llm, prompt, reuse_params, paged=False)
    assert max_logprob_diff(generic_lp, reuse_lp) > 100 * LOGPROB_TOL

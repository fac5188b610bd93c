"""What a plan carries to the worker: the parsed segments and the chunk keys the scheduler hashed."""

from __future__ import annotations

import pickle

from cachefuse.chunks import Segment, chunk_key
from tests.vllm.scheduler_side.test_hooks import make_side, request, schedule  # noqa: F401 - make_side: a fixture


def test_a_plan_carries_the_parsed_segments_and_rank_0s_chunk_keys(make_side):  # noqa: F811
    side = make_side()
    req = request("r1")  # chunks [0, 10) and [10, 60) of 100 tokens
    [plan] = schedule(side, req)
    prompt = req.prompt_token_ids
    assert plan.segments == (Segment(0, 10, is_chunk=True, is_system=True), Segment(10, 50, is_chunk=True, is_system=False),
                             Segment(60, 40, is_chunk=False, is_system=False))
    assert plan.chunk_keys == (chunk_key(prompt[0:10], side.key_context, at_prompt_start=True),
                               chunk_key(prompt[10:60], side.key_context))
    again = pickle.loads(pickle.dumps(plan))  # vLLM pickles the metadata between processes
    assert again.segments == plan.segments and again.chunk_keys == plan.chunk_keys

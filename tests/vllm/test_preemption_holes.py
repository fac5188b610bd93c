"""Preemption of fused requests with holes: the request's first blend saves its holes, and by the time vLLM
resumes it the scheduler's index holds them. Planned afresh, the resumed blend loaded them as hits and the
selector's rows went elsewhere: vLLM decoded the rest of the answer over other K/V than its first tokens
came from (2 of 6 answers changed), and every reuse was counted again in f_r. The resumed blend replays
the first plan instead (scheduler_side.planning.Planner._replay).

Two engines, one after the other, each on a fresh store with the same base variants: the reference runs
each request alone (no preemption, each hole computed in full and saved), the other runs the six at once
in a KV cache of 1,024 tokens, which preempts. Every hole is a chunk no other request has.
"""

from __future__ import annotations

import pytest

from tests.helpers import vllm_engines as engines

SMALL_KV_CACHE = dict(kv_cache_memory_bytes=2 << 20, max_model_len=512)  # 1,024 tokens of the tiny llama
MAX_TOKENS = 150
ORDERS = [("system", "a", "h0", "c", "question"), ("system", "c", "h1", "d", "question"),
          ("system", "d", "h2", "a", "question"), ("system", "b", "h3", "d", "question"),
          ("system", "a", "h4", "c", "question"), ("system", "c", "h5", "a", "question")]


def run(tiny_model_dir, store, batched: bool):
    llm = engines.start_engine(tiny_model_dir("llama"), store, SMALL_KV_CACHE)
    try:
        pieces = engines.random_pieces(5, {"system": 20, "a": 60, "b": 50, "c": 40, "d": 45, "question": 10,
                                           **{f"h{i}": 40 for i in range(len(ORDERS))}})
        engines.precompute(llm, pieces["system"], [pieces[name] for name in "abcd"])
        prompts, params = zip(*(engines.named_prompt(pieces, order, selector="cacheblend", recompute_ratio=0.15)
                                for order in ORDERS), strict=True)
        if batched:
            outputs = engines.generate(llm, list(prompts), list(params), MAX_TOKENS)
        else:
            outputs = [engines.generate(llm, [ids], [p], MAX_TOKENS)[0] for ids, p in zip(prompts, params, strict=True)]
        engine = engines.worker_side().engine
        assert engine.saver is None or engine.saver.flush(30)
        f_r = sorted((r.variant_id, r.access_count) for r in engine.metastore.all_records())
        return outputs, f_r
    finally:
        engines.stop_engine(llm)


def test_a_preempted_request_with_holes_gives_its_unpreempted_answer(tiny_model_dir, tmp_path):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # it overrides kv_cache_memory_bytes (whole GiB)
        alone, uses_alone = run(tiny_model_dir, tmp_path / "alone", batched=False)
        batch, uses_batched = run(tiny_model_dir, tmp_path / "batched", batched=True)
    preempted = [o.kv_transfer_params["cachefuse"].get("preemptions", 0) for o in batch]
    assert sum(preempted) > 0, "no request was preempted: the KV cache is too large for this test"
    for want, got, times in zip(alone, batch, preempted, strict=True):
        stats = got.kv_transfer_params["cachefuse"]
        assert stats["status"] == "fused" and stats["chunks_hit"] == 3 and stats["chunks_missed"] == 1, stats
        assert stats.get("replay_exact", True) is True
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, f"preempted {times} time(s)"
    assert uses_batched == uses_alone  # a replay counts no reuse again

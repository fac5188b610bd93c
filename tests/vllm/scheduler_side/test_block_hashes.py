"""Blended blocks hashed apart from plain ones: a fused request's chain is salted from its first block
after vLLM's own hit; the blocks before it, and every plain request's, keep vLLM's hashes."""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from cachefuse.vllm.scheduler_side.block_hashes import BlendHashes

BLOCK = 4


@pytest.fixture(scope="module")
def hasher():
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK, hash_fn)


def make_request(hasher, req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, list(tokens), SamplingParams(max_tokens=8), None, block_hasher=hasher)


def test_salting_keeps_the_hit_and_parts_the_rest(hasher):
    tokens = list(range(100, 118))  # 4 full blocks and 2 tokens
    plain, fused = make_request(hasher, "plain", tokens), make_request(hasher, "fused", tokens)
    assert plain.block_hashes == fused.block_hashes  # control: alike before salting, what the cache matches on
    hashes = BlendHashes("sha256", BLOCK)
    hashes.salt(fused, 1)
    assert len(fused.block_hashes) == 4
    assert fused.block_hashes[0] == plain.block_hashes[0]  # vLLM's exact hit stays shareable
    assert not set(fused.block_hashes[1:]) & set(plain.block_hashes)  # the blended ones match nobody's
    other = make_request(hasher, "other", tokens)
    hashes.salt(other, 1)
    assert not set(other.block_hashes[1:]) & set(fused.block_hashes[1:])  # nor another fused request's


def test_decoded_blocks_chain_from_the_salt_and_a_resalt_reproduces_the_chain(hasher):
    tokens = list(range(200, 210))  # 2 full blocks, the third partial
    plain, fused = make_request(hasher, "plain", tokens), make_request(hasher, "fused", tokens)
    hashes = BlendHashes("sha256", BLOCK)
    hashes.salt(fused, 2)  # the blend's first block is not full yet
    assert fused.block_hashes == plain.block_hashes
    for request in (plain, fused):
        request.append_output_token_ids([7, 8, 9, 10, 11, 12])  # fills block 2 and block 3
    assert len(fused.block_hashes) == len(plain.block_hashes) == 4
    assert fused.block_hashes[:2] == plain.block_hashes[:2]
    assert fused.block_hashes[2] != plain.block_hashes[2]  # salted when the decoded token filled it
    assert fused.block_hashes[3] != plain.block_hashes[3]  # and the chain goes on from it
    before = list(fused.block_hashes)
    hashes.salt(fused, 3)  # a later plan, finding its own blocks (a resumption): the chain is kept
    assert fused.block_hashes == before
    hashes.salt(fused, 1)  # a shorter hit: salted from there, with the request's same salt
    assert fused.block_hashes[0] == plain.block_hashes[0] and fused.block_hashes[1] != plain.block_hashes[1]


def test_a_request_salt_at_block_zero_keeps_vllms_cache_salt(hasher):
    tokens = list(range(300, 308))
    a = Request("a", tokens, SamplingParams(max_tokens=1), None, cache_salt="tenant-a", block_hasher=hasher)
    b = Request("b", tokens, SamplingParams(max_tokens=1), None, cache_salt="tenant-b", block_hasher=hasher)
    hashes = BlendHashes("sha256", BLOCK)
    hashes.salt(a, 0)
    hashes.salt(b, 0)
    assert not set(a.block_hashes) & set(b.block_hashes)

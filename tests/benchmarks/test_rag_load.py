"""benchmarks/rag_load.py's pure parts: the RAG prompts and their declared chunks, the hit rate, and the
Poisson arrival schedule. No server."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest
import rag_load
from rag_load import QUESTION_TOKENS, SYSTEM_TOKENS, RagWorkload, poisson_arrivals

DOC_LENGTHS = (60, 120)


@pytest.fixture(scope="module")
def workload() -> RagWorkload:
    return RagWorkload(DOC_LENGTHS, num_docs=12, docs_per_prompt=3, seed=0)


def documents_of(prompt: rag_load.RagPrompt) -> list[list[int]]:
    return [prompt.ids[start:end] for start, end in prompt.chunks[1:]]


@pytest.mark.parametrize("hit", [True, False])
def test_chunks_tile_system_and_documents(workload, hit):
    rng = random.Random(1)
    for _ in range(50):
        prompt = workload.prompt(rng, hit)
        assert prompt.chunks[0] == [0, SYSTEM_TOKENS]
        assert prompt.ids[:SYSTEM_TOKENS] == workload.system
        for (_, end), (start, _) in itertools.pairwise(prompt.chunks):
            assert start == end  # no gap, no overlap
        assert len(prompt.chunks) == 1 + 3
        assert len(prompt.ids) == prompt.chunks[-1][1] + QUESTION_TOKENS  # the question follows, undeclared
        assert all(DOC_LENGTHS[0] <= len(doc) <= DOC_LENGTHS[1] for doc in documents_of(prompt))


def test_a_hit_holds_distinct_stored_documents_in_varying_orders(workload):
    rng = random.Random(2)
    prompts = [workload.prompt(rng, hit=True) for _ in range(50)]
    for prompt in prompts:
        indices = [workload.docs.index(doc) for doc in documents_of(prompt)]  # raises if one is not stored
        assert len(set(indices)) == 3
    assert len({tuple(map(tuple, documents_of(p))) for p in prompts}) > 40  # orders and picks vary


def test_a_miss_swaps_exactly_one_document_for_a_never_seen_one(workload):
    rng = random.Random(3)
    for _ in range(50):
        prompt = workload.prompt(rng, hit=False)
        assert not prompt.hit
        assert sum(doc not in workload.docs for doc in documents_of(prompt)) == 1


@pytest.mark.parametrize("hit_rate", [1.0, 0.7, 0.0])
def test_the_hit_rate_is_respected(workload, hit_rate):
    rng = random.Random(4)
    prompts = [workload.draw(rng, hit_rate) for _ in range(4000)]
    for prompt in prompts[:200]:  # the flag says what the prompt holds
        assert prompt.hit == all(doc in workload.docs for doc in documents_of(prompt))
    hits = sum(p.hit for p in prompts) / len(prompts)
    sigma = (hit_rate * (1 - hit_rate) / len(prompts)) ** 0.5
    assert abs(hits - hit_rate) <= 4 * sigma + 1e-9


def test_the_same_seed_gives_every_configuration_the_same_prompts():
    first, second = RagWorkload(DOC_LENGTHS, seed=5), RagWorkload(DOC_LENGTHS, seed=5)
    assert first.docs == second.docs and first.system == second.system
    assert [first.draw(random.Random("p"), 0.5).ids for _ in range(3)] == \
        [second.draw(random.Random("p"), 0.5).ids for _ in range(3)]
    assert RagWorkload(DOC_LENGTHS, seed=6).docs != first.docs


def test_storing_prompts_declare_the_system_prompt_and_one_document_each(workload):
    prompts = workload.storing_prompts()
    assert [documents_of(p) for p in prompts] == [[doc] for doc in workload.docs]
    assert all(p.chunks[0] == [0, SYSTEM_TOKENS] for p in prompts)


def test_more_documents_per_prompt_than_stored_is_refused():
    with pytest.raises(ValueError, match="docs_per_prompt"):
        RagWorkload(DOC_LENGTHS, num_docs=2, docs_per_prompt=3)


@pytest.mark.parametrize("rate", [0.5, 5.0, 40.0])
def test_poisson_arrivals_come_at_the_mean_rate_with_exponential_gaps(rate):
    duration_s = 2000 / rate  # ~2000 arrivals
    arrivals = poisson_arrivals(rate, duration_s, seed=7)
    assert arrivals == sorted(arrivals) and 0 <= arrivals[0] and arrivals[-1] < duration_s
    expected = rate * duration_s
    assert abs(len(arrivals) - expected) <= 4 * expected ** 0.5  # Poisson count: sd = sqrt(mean)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert statistics.mean(gaps) == pytest.approx(1 / rate, rel=0.1)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.1)  # exponential: CV 1


def test_poisson_arrivals_are_seeded():
    assert poisson_arrivals(3.0, 20, seed="a") == poisson_arrivals(3.0, 20, seed="a")
    assert poisson_arrivals(3.0, 20, seed="a") != poisson_arrivals(3.0, 20, seed="b")
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(0.0, 20, seed=0)

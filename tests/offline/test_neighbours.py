"""Offline neighbour fusion (cachefuse/offline/neighbours.py) on the reference engine and a tiny model.

- neighbours are the most cosine-similar other chunks, most similar first, never the chunk itself;
- each chunk gets a variant whose prefix is its neighbours, with statistics, and a prompt holding the
  neighbours in that order loads it at CFO 0 (a prompt without them loads the base variant: the
  negative control);
- loading that variant in its own prompt equals computing the chunk there (it is what a full_reuse
  pass computes for the chunk as a hole), and differs from loading the base variant;
- the neighbour variants are marked `neighbour_fused` (the base variants, and a hole a served prompt saves
  after the same engine's chunks, are not);
- under `default_variant: fused` (the default) a chunk after unrelated chunks loads its neighbour variant
  (under "base", the negative control, its base variant); unmarked, as a store written before records
  carried their origin holds it, the base variant;
- a second run stores nothing (resumable) and marks a neighbour variant stored unmarked, and bad arguments
  fail naming what is wrong.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch

from cachefuse.config import CacheFuseConfig
from cachefuse.offline.neighbours import fuse_neighbours, lexical_embedder, model_embedder, top_neighbours
from tests.helpers.fusion import make_engine


def random_ids(vocab: int, lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def designed_embedder(vectors):
    """An embedder that ignores the ids and returns fixed vectors (the neighbours are then known)."""
    return lambda chunks: np.asarray(vectors[:len(chunks)], dtype=np.float64)


# Chunks 0 and 1 point the same way, 2 and 3 the same way, 4 in between.
VECTORS = [[1.0, 0.0, 0.0], [0.9, 0.1, 0.0], [0.0, 1.0, 0.0], [0.0, 0.95, 0.05], [0.5, 0.5, 0.7]]


def test_top_neighbours_are_the_most_similar_others_most_similar_first():
    assert top_neighbours(VECTORS, 2) == [[1, 4], [0, 4], [3, 4], [2, 4], [1, 3]]
    assert top_neighbours(VECTORS, 0) == [[]] * 5
    assert top_neighbours(VECTORS, 9)[0] == [1, 4]  # never itself, nor 2 and 3 (orthogonal to it)
    assert top_neighbours([[1.0, 0.0], [1.0, 0.0], [2.0, 0.0]], 1) == [[1], [0], [0]]  # ties: lower index
    assert top_neighbours([[1.0, 0.0], [0.0, 0.0], [0.5, 0.0]], 2) == [[2], [], [0]]  # a zero vector: none
    assert top_neighbours([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], 2) == [[], [], []]  # nothing in common
    ids = [[5, 6], [5, 6], [7, 8]]  # the same chunk listed twice is not its own neighbour
    assert top_neighbours([[1.0, 0.0], [1.0, 0.0], [0.9, 0.1]], 1, ids) == [[2], [2], [0]]
    with pytest.raises(ValueError, match="count=-1"):
        top_neighbours(VECTORS, -1)
    with pytest.raises(ValueError, match="expected \\[num_chunks, dim\\]"):
        top_neighbours([1.0, 2.0], 1)


@contextlib.contextmanager
def default_variant(engine, value: str):
    """The engine planning under `default_variant: value` inside the block."""
    previous = engine.config
    engine.config = previous.replace(default_variant=value)
    try:
        yield
    finally:
        engine.config = previous


def prompt_of(system, pieces, question):
    ids, offsets = list(system), [(0, len(system))]
    for piece in pieces:
        offsets.append((len(ids), len(ids) + len(piece)))
        ids += piece
    return ids + question, offsets


@pytest.fixture(scope="module")
def fused(adapter):
    vocab = adapter.shape.vocab_size
    system, *chunks = random_ids(vocab, (9, 21, 17, 19, 23, 15), seed=3)
    engine = make_engine(adapter)
    report = fuse_neighbours(engine, system, chunks, 2, embedder=designed_embedder(VECTORS), progress=False)
    return engine, system, chunks, report


def test_every_chunk_gets_a_variant_after_its_neighbours_with_statistics(fused):
    engine, system, chunks, report = fused
    assert report.neighbours == top_neighbours(VECTORS, 2)
    assert report.stored == [0, 1, 2, 3, 4] and not report.failed and len(report.seconds) == 5
    for index, neighbours in enumerate(report.neighbours):
        variants = engine.metastore.variants(engine.meta_key(chunks[index]))
        prefixes = {v.prefix: v for v in variants}
        assert () in prefixes  # the base variant stays
        variant = prefixes[tuple(engine.meta_key(chunks[j]) for j in neighbours)]
        assert variant.has_stats and variant.ranked_tokens and sum(variant.inter.values()) > 0
        assert variant.neighbour_fused and not prefixes[()].neighbour_fused


def test_a_served_prompts_hole_is_not_marked(fused, adapter):
    """The same engine saving a hole for a served prompt (chunk 2 after chunk 0, computed in full) stores an
    unmarked variant: only the neighbour step marks. Control: the step's own save of the same pass shape
    (FusePlan.neighbour_variant) marks it."""
    engine, system, chunks, _ = fused
    question = random_ids(adapter.shape.vocab_size, (7,), seed=9)[0]
    ids, offsets = prompt_of(system, [chunks[0], chunks[2]], question)
    choices = list(engine.plan_variants(ids, offsets))
    prefix = (engine.meta_key(chunks[0]),)

    def saved(**plan_fields):
        _, stats = engine.prefill(ids, offsets, selector="full_reuse", ratio=0.0, variants=choices[:-1] + [None],
                                  save_inline=True, **plan_fields)
        return [r for r in stats.saved_variants if r.prefix == prefix]

    (served,) = saved()
    assert not served.neighbour_fused and not engine.metastore.get(served.variant_id).neighbour_fused
    engine.metastore.remove(served.variant_id)
    engine.store.remove(served.store_key)
    (marked,) = saved(neighbour_variant=True)  # control
    assert marked.neighbour_fused and engine.metastore.get(marked.variant_id).neighbour_fused
    engine.metastore.remove(marked.variant_id)
    engine.store.remove(marked.store_key)


def test_a_prompt_holding_the_neighbours_loads_the_variant_at_cfo_zero(fused):
    engine, system, chunks, report = fused
    question = random_ids(engine.adapter.shape.vocab_size, (7,), seed=4)[0]
    neighbours = report.neighbours[2]  # [3, 4]
    ids, offsets = prompt_of(system, [chunks[j] for j in neighbours] + [chunks[2]], question)
    choice = engine.plan_variants(ids, offsets)[-1]
    variant = {v.variant_id: v for v in engine.metastore.variants(engine.meta_key(chunks[2]))}[choice.variant_id]
    assert variant.prefix == tuple(engine.meta_key(chunks[j]) for j in neighbours) and choice.cfo == 0.0
    ids, offsets = prompt_of(system, [chunks[0], chunks[2]], question)  # negative control: no neighbour before it
    with default_variant(engine, "base"):  # Cache-Craft's choice alone ("fused" loads it there too: below)
        choice = engine.plan_variants(ids, offsets)[-1]
    assert {v.variant_id: v for v in engine.metastore.variants(engine.meta_key(chunks[2]))}[choice.variant_id].prefix == ()


def test_under_default_variant_fused_a_chunk_after_unrelated_chunks_loads_its_neighbour_variant(fused):
    """FusionRAG's use: the neighbour-fused cache wherever the chunk appears. Chunk 2's neighbours are 3 and 4;
    after chunk 0 alone the default engine ("fused") loads its neighbour variant, a "base" engine (negative
    control) its base variant, and the two prefills differ; the first chunk keeps its exact base variant
    either way."""
    engine, system, chunks, report = fused
    assert engine.config.default_variant == "fused"  # the default
    question = random_ids(engine.adapter.shape.vocab_size, (7,), seed=6)[0]
    ids, offsets = prompt_of(system, [chunks[0], chunks[2]], question)
    by_id = {v.variant_id: v for v in engine.metastore.variants(engine.meta_key(chunks[2]))}
    neighbours = tuple(engine.meta_key(chunks[j]) for j in report.neighbours[2])
    fused_choices = engine.plan_variants(ids, offsets)
    fused_out, fused_stats = engine.prefill(ids, offsets, selector="full_reuse", ratio=0.0, save_holes=False)
    with default_variant(engine, "base"):
        base_choices = engine.plan_variants(ids, offsets)
        base_out, _ = engine.prefill(ids, offsets, selector="full_reuse", ratio=0.0, save_holes=False)
    assert by_id[fused_choices[2].variant_id].prefix == neighbours
    assert fused_stats.chunks_hit == len(offsets) and fused_stats.chunk_cfo[2] == pytest.approx(
        by_id[fused_choices[2].variant_id].cci)
    assert by_id[base_choices[2].variant_id].prefix == ()  # negative control
    assert fused_choices[1].variant_id == base_choices[1].variant_id  # chunk 0 is first: its exact base variant
    assert by_id[fused_choices[2].variant_id].prefix != by_id[base_choices[2].variant_id].prefix
    assert (fused_out.logits - base_out.logits).abs().max() > 1e-4


def test_the_variant_is_what_a_full_reuse_pass_computes_for_the_chunk_there(fused, adapter):
    """With the neighbours loaded as the step loaded them (as under "base": Eq. 10's base caches; under the
    default "fused" a later neighbour loads its own neighbour variant instead, which the chunk's variant did
    not see)."""
    engine, system, chunks, report = fused
    question = random_ids(adapter.shape.vocab_size, (7,), seed=5)[0]
    neighbours = report.neighbours[0]
    ids, offsets = prompt_of(system, [chunks[j] for j in neighbours] + [chunks[0]], question)
    with default_variant(engine, "base"):
        loaded, stats = engine.prefill(ids, offsets, selector="full_reuse", ratio=0.0, save_holes=False)
        choices = list(engine.plan_variants(ids, offsets))
    assert stats.chunks_hit == len(offsets) and stats.chunk_cfo[-1] == 0.0
    computed, _ = engine.prefill(ids, offsets, selector="full_reuse", ratio=0.0, save_holes=False,
                                 variants=choices[:-1] + [None])
    assert torch.allclose(loaded.logits, computed.logits, atol=1e-5)
    base = make_engine(adapter)  # negative control: the same prompt over base variants only
    base.precompute([system])
    base.precompute(chunks, prefix_ids=system)
    plain, _ = base.prefill(ids, offsets, selector="full_reuse", ratio=0.0, save_holes=False)
    assert (plain.logits - loaded.logits).abs().max() > 1e-3


def test_a_second_run_is_resumed_and_stores_nothing(fused):
    engine, system, chunks, _ = fused
    before = {i: len(engine.metastore.variants(engine.meta_key(c))) for i, c in enumerate(chunks)}
    again = fuse_neighbours(engine, system, chunks, 2, embedder=designed_embedder(VECTORS), progress=False)
    assert again.stored == [] and again.skipped == [0, 1, 2, 3, 4] and again.marked == []
    assert {i: len(engine.metastore.variants(engine.meta_key(c))) for i, c in enumerate(chunks)} == before


def test_an_unmarked_neighbour_variant_loads_the_base_one_until_a_run_marks_it(fused):
    """A store written before records carried their origin holds chunk 2's neighbour variant unmarked: under
    "fused" the chunk after unrelated chunks loads its base variant (the old rule loaded any variant after
    other chunks: the negative control is the marked one above). A re-run marks it without recomputing it
    (its K/V untouched), and the chunk loads it again."""
    engine, system, chunks, report = fused
    key = engine.meta_key(chunks[2])
    neighbours = tuple(engine.meta_key(chunks[j]) for j in report.neighbours[2])
    (variant,) = [v for v in engine.metastore.variants(key) if v.prefix == neighbours]
    engine.metastore.put(dataclasses.replace(variant, neighbour_fused=False))  # as the previous code stored it
    question = random_ids(engine.adapter.shape.vocab_size, (7,), seed=6)[0]
    ids, offsets = prompt_of(system, [chunks[0], chunks[2]], question)
    assert engine.plan_variants(ids, offsets)[2].store_key == key  # the base variant
    entry = engine.store.get(variant.store_key)
    again = fuse_neighbours(engine, system, chunks, 2, embedder=designed_embedder(VECTORS), progress=False)
    assert again.stored == [] and again.marked == [2]
    assert engine.metastore.get(variant.variant_id).neighbour_fused
    assert engine.plan_variants(ids, offsets)[2].variant_id == variant.variant_id
    assert all(torch.equal(a, b) for a, b in zip(engine.store.get(variant.store_key).k_nope, entry.k_nope,
                                                 strict=True))


def test_the_model_embedder_and_bad_arguments(adapter):
    engine = make_engine(adapter)
    system, *chunks = random_ids(adapter.shape.vocab_size, (6, 11, 11, 13), seed=8)
    vectors = model_embedder(engine)(chunks + [chunks[0]])
    assert vectors.shape == (4, adapter.shape.hidden_size) and np.allclose(vectors[0], vectors[3])
    assert not np.allclose(vectors[0], vectors[1])
    near = chunks[:2] + [chunks[0][:-1] + [chunks[0][-1] % 50 + 3]]  # chunks 0 and 2 differ in one token
    report = fuse_neighbours(engine, system, near, 1, progress=False)  # the default embedder
    assert report.neighbours[0] == [2] and report.neighbours[2] == [0]
    assert report.stored == [i for i, n in enumerate(report.neighbours) if n] and {0, 2} <= set(report.stored)
    with pytest.raises(ValueError, match="num_neighbours=-2"):
        fuse_neighbours(engine, system, chunks, -2, progress=False)
    with pytest.raises(ValueError, match="system_ids is empty"):
        fuse_neighbours(engine, [], chunks, 1, progress=False)
    with pytest.raises(ValueError, match="returned 2 rows for 3 chunks"):
        fuse_neighbours(make_engine(adapter), system, chunks, 1, embedder=designed_embedder(VECTORS[:2]),
                        progress=False)


def test_the_lexical_embedder_links_chunks_that_share_rare_tokens():
    common = [5, 6, 7, 8]
    chunks = [common + [40, 41], common + [50, 51], common + [40, 41, 9], common + [50, 51, 9]]
    vectors = lexical_embedder(64)(chunks)
    assert vectors.shape == (4, 64)
    assert top_neighbours(vectors, 1) == [[2], [3], [0], [1]]  # the shared rare pair decides, not `common`
    assert not np.any(vectors[:, 5:9] > vectors[:, 40:41].max())  # tokens in every chunk weigh least


def test_under_cachecraft_admission_stores_no_neighbour_as_a_side_effect(adapter):
    """cachecraft admits one chunk per request by default; the fusion pass must store only its chunk."""
    system, *chunks = random_ids(adapter.shape.vocab_size, (9, 21, 17, 19, 23, 15), seed=3)
    engine = make_engine(adapter, CacheFuseConfig(selector="cachecraft"))
    assert engine.config.admission_cfo is not None  # negative control: admission is on in this engine
    report = fuse_neighbours(engine, system, chunks, 2, embedder=designed_embedder(VECTORS), progress=False)
    assert report.stored == [0, 1, 2, 3, 4]
    for index, chunk in enumerate(chunks):
        prefixes = {v.prefix for v in engine.metastore.variants(engine.meta_key(chunk))}
        assert prefixes == {(), tuple(engine.meta_key(chunks[j]) for j in report.neighbours[index])}

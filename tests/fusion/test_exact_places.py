"""Exact places through the reference engine (FusionEngine): a chunk placed after exactly the tokens its
variant was computed after is reused as exact (no candidate, no row recomputed, the ratio spent on the other
chunks), and a hole records its place only when every row before it in its pass was exact.

The index's choice and the backends' column are tests/metadata/test_exact_places.py's; the vLLM path is
tests/vllm/test_exact_places_e2e.py's.
"""

from __future__ import annotations

import math

import torch

from cachefuse.chunks import place_hash
from cachefuse.config import CacheFuseConfig
from cachefuse.select.base import num_rows_for_ratio
from tests.helpers.fusion import make_case, make_engine, precompute_case
from tests.helpers.tolerances import TOL
from tests.metadata.test_variants import prompt

RATIO = 0.5


def rows_in(result, start: int, end: int) -> int:
    """Rows of [start, end) computed at the pass's last layer."""
    rows = result.rows_per_layer[-1]
    return end - start if rows is None else int(((rows >= start) & (rows < end)).sum())


def with_separator(case, order, separator: int):
    """`prompt(case, order)` with one undeclared token between the system prompt and the first chunk."""
    ids, chunks = prompt(case, order)
    n = len(case.system)
    return ids[:n] + [separator] + ids[n:], [chunks[0]] + [(s + 1, e + 1) for s, e in chunks[1:]]


def full_kv(engine, ids, chunks):
    """The full prefill's result over the same prompt (every chunk computed, nothing loaded or saved)."""
    result, _ = engine.prefill(ids, chunks, selector="full_prefill", save_holes=False,
                               variants=[None] * len(chunks))
    return result


def test_chunk_at_its_exact_place_spends_no_rows_and_equals_full_prefill(adapter):
    """[system][A][B][question]: A's base variant was computed after exactly the system prompt, so A is no
    candidate: cacheblend at ratio r spends ceil(r |B|) rows, all in B, none in A; A's K/V are a full
    prefill's (after cacheblend's full layers, V bit-exact with the full prefill of [system][A] that stored
them; at every layer K and V equal to this
prompt's full prefill to fp32 rounding: a longer pass rounds its matmuls differently). Negative control: one separator token between the
    system prompt and A (the same variant is loaded) makes A approximate, a candidate like B."""
    case = make_case(adapter.shape.vocab_size, seed=41)
    engine = make_engine(adapter, CacheFuseConfig(recompute_ratio=RATIO))
    precompute_case(engine, case, with_hole=False)
    len_a, len_b = len(case.pieces[0]), len(case.pieces[1])

    ids, chunks = prompt(case, [0, 1])
    result, stats = engine.prefill(ids, chunks)
    (a_start, a_end), (b_start, b_end) = chunks[1], chunks[2]
    assert stats.exact_prefix_chunks == 1 and stats.exact_prefix_tokens == len_a
    assert stats.chunks_hit == 3 and result.num_candidates == len_b
    assert result.num_selected == num_rows_for_ratio(RATIO, len_b)
    assert rows_in(result, a_start, a_end) == 0 and rows_in(result, b_start, b_end) == result.num_selected
    at_place = engine.compute_chunk(case.pieces[0], case.system)  # a full prefill of [system][A]
    full = full_kv(engine, ids, chunks)
    num_full = engine.fusor_full_layers("cacheblend")  # its full layers compute every row, exact or not
    for layer in range(adapter.shape.num_layers):
        if layer >= num_full:
            assert torch.equal(result.v[layer][a_start:a_end], at_place.v[layer])  # the stored rows, untouched
        for fused, whole in ((result.k, full.k), (result.v, full.v)):  # this prompt's prefill: fp32 rounding
            torch.testing.assert_close(fused[layer][a_start:a_end], whole[layer][a_start:a_end], **TOL[torch.float32])

    separator = (case.system[-1] + 1) % adapter.shape.vocab_size
    ids2, chunks2 = with_separator(case, [0, 1], separator)
    control, approx = engine.prefill(ids2, chunks2)
    assert approx.exact_prefix_chunks == 0 and approx.exact_prefix_tokens == 0 and approx.chunk_cfo[1] == 0.0
    assert control.num_candidates == len_a + len_b
    assert control.num_selected == num_rows_for_ratio(RATIO, len_a + len_b)
    assert rows_in(control, *chunks2[1]) > 0


def test_prompt_of_exact_chunks_equals_full_prefill(adapter):
    """[system][A][question] at ratio r: nothing is a candidate, only the question is recomputed after the
    full layers, and the logits equal the full prefill's. Negative control: with A's record stripped of its
    place (a store written before exact places), A is a candidate and r of its rows are recomputed."""
    case = make_case(adapter.shape.vocab_size, seed=42)
    engine = make_engine(adapter, CacheFuseConfig(recompute_ratio=RATIO))
    precompute_case(engine, case, with_hole=False)
    ids, chunks = prompt(case, [0])
    result, stats = engine.prefill(ids, chunks)
    assert result.num_candidates == 0 and result.num_selected == 0
    assert stats.tokens_recomputed == len(case.question) and stats.exact_prefix_chunks == 1
    torch.testing.assert_close(result.logits, full_kv(engine, ids, chunks).logits, **TOL[torch.float32])

    key_a = engine.meta_key(case.pieces[0])
    (record,) = engine.metastore.variants(key_a)
    assert record.exact_after == place_hash(case.system)
    engine.metastore.remove(record.variant_id)
    engine.metastore.put(record.__class__.without_stats(key_a, (), record.num_tokens))  # no place
    control, old = engine.prefill(ids, chunks)
    assert old.exact_prefix_chunks == 0 and control.num_candidates == len(case.pieces[0])
    assert control.num_selected == math.ceil(RATIO * len(case.pieces[0]))


def test_hole_after_exact_rows_records_its_place_and_is_then_exact(adapter):
    """[system][A][B hole][question]: every row before B is exact (the system chunk, A at its place), so B's
    variant records B's place; the same prompt with C after B then serves A and B as exact, and B's loaded
    K/V equal the full prefill's. Negative control: after a separator, A is approximate (its candidates
    partly recomputed), so the hole B saved there records no place."""
    case = make_case(adapter.shape.vocab_size, seed=43)
    engine = make_engine(adapter, CacheFuseConfig(recompute_ratio=RATIO))
    precompute_case(engine, case)  # B stays a hole
    key_b = engine.meta_key(case.pieces[1])
    ids, chunks = prompt(case, [0, 1])
    _, stats = engine.prefill(ids, chunks, save_inline=True)
    (saved,) = stats.saved_variants
    assert saved.chunk_key == key_b and saved.exact_after == place_hash(ids[:chunks[2][0]])

    ids3, chunks3 = prompt(case, [0, 1, 2])
    result, again = engine.prefill(ids3, chunks3, save_inline=True)
    assert again.exact_prefix_chunks == 2 and again.exact_prefix_tokens == len(case.pieces[0]) + len(case.pieces[1])
    assert result.num_candidates == len(case.pieces[2])  # C's base variant: approximate after A, B
    full = full_kv(engine, ids3, chunks3)
    b_start, b_end = chunks3[2]
    for layer in range(adapter.shape.num_layers):
        torch.testing.assert_close(result.k[layer][b_start:b_end], full.k[layer][b_start:b_end], **TOL[torch.float32])
        torch.testing.assert_close(result.v[layer][b_start:b_end], full.v[layer][b_start:b_end], **TOL[torch.float32])

    control_engine = make_engine(adapter, CacheFuseConfig(recompute_ratio=RATIO))
    precompute_case(control_engine, case)
    ids2, chunks2 = with_separator(case, [0, 1], (case.system[-1] + 1) % adapter.shape.vocab_size)
    _, control = control_engine.prefill(ids2, chunks2, save_inline=True)
    (approx,) = control.saved_variants
    assert approx.chunk_key == key_b and approx.exact_after is None and control.exact_prefix_chunks == 0


def test_hole_after_loaded_rows_recomputed_everywhere_is_exact(adapter):
    """A loaded chunk at no exact place whose every row was recomputed at every layer (full_prefill) is
    exact all the same, so a hole after it records its place; the same prompt under full_reuse (the chunk's
    rows kept as loaded) records none: the negative control."""
    case = make_case(adapter.shape.vocab_size, seed=44)
    separator = (case.system[-1] + 1) % adapter.shape.vocab_size
    ids, chunks = with_separator(case, [0, 1], separator)
    for selector, exact in (("full_prefill", True), ("full_reuse", False)):
        engine = make_engine(adapter, CacheFuseConfig(recompute_ratio=RATIO))
        precompute_case(engine, case)
        _, stats = engine.prefill(ids, chunks, selector=selector, save_inline=True)
        assert stats.chunks_hit == 2 and stats.exact_prefix_chunks == 0  # the system chunk and A
        (saved,) = stats.saved_variants
        assert (saved.exact_after == place_hash(ids[:chunks[2][0]])) is exact, selector


def test_exact_places_off_blends_the_chunk_at_its_exact_place_like_any_other(adapter):
    """`exact_places: false` (measuring what exact places save, benchmarks/frontier.py): the same prompt as
    above plans A as approximate, so A's rows are candidates with B's and the ratio is spent over both, as
    the papers blend. Negative control: the default engine on the same store and prompt marks A exact."""
    case = make_case(adapter.shape.vocab_size, seed=41)
    engine = make_engine(adapter, CacheFuseConfig(recompute_ratio=RATIO))
    precompute_case(engine, case, with_hole=False)
    len_a, len_b = len(case.pieces[0]), len(case.pieces[1])
    ids, chunks = prompt(case, [0, 1])

    _, on = engine.prefill(ids, chunks, save_holes=False)
    assert on.exact_prefix_chunks == 1 and on.exact_prefix_tokens == len_a
    engine.config = engine.config.replace(exact_places=False)
    assert not any(c.exact for c in engine.plan_variants(ids, chunks) if c is not None)
    result, off = engine.prefill(ids, chunks, save_holes=False)
    assert off.exact_prefix_chunks == 0 and off.exact_prefix_tokens == 0 and off.chunks_hit == 3
    assert result.num_candidates == len_a + len_b
    assert result.num_selected == num_rows_for_ratio(RATIO, len_a + len_b)
    assert rows_in(result, *chunks[1]) > 0

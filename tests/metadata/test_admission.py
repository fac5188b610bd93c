"""Variant admission (cachefuse/metadata/index.py, rule 4): which stored chunks a prompt computes in full so
they are stored for its prefix, as served requests arrive; the default per selector (on under cachecraft only).

The vLLM path (scheduler plans, worker saves, metadata flows back) is tests/vllm/test_variants_e2e.py's and
tests/vllm/scheduler_side/test_hooks.py's.
"""

from __future__ import annotations

import math

import pytest
import torch

from cachefuse.config import CacheFuseConfig
from cachefuse.config_checks import SELECTORS
from cachefuse.metadata import scores
from cachefuse.metadata.base import VariantRecord
from cachefuse.metadata.index import Admission, VariantIndex, plan_variants
from tests.helpers.fusion import make_case, make_engine, precompute_case
from tests.helpers.tolerances import TOL
from tests.metadata.test_variants import prompt


def test_config_resolves_the_threshold_from_the_selector_and_alpha():
    assert CacheFuseConfig().admission_cfo is None  # cacheblend: off unless set
    assert CacheFuseConfig(selector="cachecraft").admission_cfo == 0.5  # a base variant's CFO after a prefix
    assert CacheFuseConfig(selector="cachecraft", cachecraft_alpha=0.6).admission_cfo == pytest.approx(0.3)
    assert CacheFuseConfig(selector="cachecraft", cachecraft_alpha=3.0).admission_cfo == 1.0  # CFO is clamped
    assert CacheFuseConfig(selector="cachecraft", cachecraft_alpha=0.0).admission_cfo is None  # every CFO is 0
    assert CacheFuseConfig(selector="cachecraft", variant_admission_max_chunks=0).admission_cfo is None
    assert CacheFuseConfig(variant_admission_cfo=0.7).admission_cfo == 0.7  # set: any selector
    assert Admission.from_config(CacheFuseConfig(selector="cachecraft")) == Admission(0.5, 1)
    assert Admission.from_config(CacheFuseConfig()) is None


@pytest.mark.parametrize("selector", SELECTORS)
def test_default_admission_is_on_only_under_cachecraft(selector):
    """The resolved default per selector (docs/variants.md, "Admission under cacheblend"): measured under
    cacheblend, a chunk in full buys no more quality than the same rows spent by the selector, so null
    stays off there and under the other selectors; an explicit threshold turns it on under any of them,
    and `variant_admission_max_chunks: 0` turns it off under any of them."""
    default = CacheFuseConfig(selector=selector)
    assert default.admission_cfo == (0.5 if selector == "cachecraft" else None)
    assert (Admission.from_config(default) is None) == (selector != "cachecraft")
    assert CacheFuseConfig(selector=selector, variant_admission_cfo=0.5).admission_cfo == 0.5
    assert CacheFuseConfig(selector=selector, variant_admission_cfo=0.5,
                           variant_admission_max_chunks=0).admission_cfo is None


def test_default_cacheblend_engine_serves_without_admitting(adapter):
    """A default-config engine (cacheblend) loads B's base variant after A at CFO 0.5 request after request
    and stores nothing. Negative control: the same engine with the threshold set admits B in the first
    request and loads the variant at CFO 0 in the second."""
    case = make_case(adapter.shape.vocab_size, seed=34)
    engine = make_engine(adapter, CacheFuseConfig())
    precompute_case(engine, case, with_hole=False)
    for stats in served(engine, case, [[0, 1, 2], [0, 1, 2]]):
        assert stats.chunk_cfo == [0.0, 0.0, 0.5, 0.5] and stats.holes_saved == 0
    assert fused_variants(engine) == []

    control = make_engine(adapter, CacheFuseConfig(variant_admission_cfo=0.5))
    precompute_case(control, case, with_hole=False)
    first, second = served(control, case, [[0, 1, 2], [0, 1, 2]])
    assert first.chunk_cfo == [0.0, 0.0, None, 0.5] and first.holes_saved == 1
    assert second.chunk_cfo == [0.0, 0.0, 0.0, None] and second.holes_saved == 1  # B loaded, C admitted


def test_at_most_max_chunks_are_admitted_highest_cfo_first():
    after_x = VariantRecord(chunk_key="C", prefix=("X",), inter={"X": 5.0}, intra=1.0, num_tokens=4,
                            prefix_num_tokens={"X": 2})  # X is in no prompt here: CFO = CCI > 0.5
    index = VariantIndex([VariantRecord.without_stats(k, (), 4) for k in ("S", "B", "D")] + [after_x])
    keys, system, lengths = ["S", "A", "B", "C", "D"], [True] + [False] * 4, [4] * 5

    def computed(admission):
        return [k for k, c in zip(keys, plan_variants(index, keys, system, lengths, 1.0, admission), strict=True)
                if c is None]

    assert after_x.cci > 0.5
    assert computed(None) == ["A"]  # A has no variant: computed anyway, and never counted
    assert computed(Admission(0.5, 1)) == ["A", "C"]  # the highest CFO
    assert computed(Admission(0.5, 2)) == ["A", "B", "C"]  # B and D tie at 0.5: the earlier one
    assert computed(Admission(0.5, None)) == ["A", "B", "C", "D"]
    assert computed(Admission(0.5, 0)) == ["A"]
    assert computed(Admission(after_x.cci + 1e-9, None)) == ["A"]  # below the threshold: loaded


def served(engine, case, orders):
    """Each order as one request in sequence (its admitted chunks saved before the next): their stats."""
    out = []
    for order in orders:
        _, stats = engine.prefill(*prompt(case, order), save_inline=True)
        out.append(stats)
    return out


def fused_variants(engine):
    return [r for r in engine.metastore.all_records() if r.prefix]


def test_served_requests_accumulate_variants_that_later_related_prefixes_choose(adapter):
    """Under the cachecraft selector's defaults: one admission per request, saved with statistics; a later
    prompt with a related prefix (B left out) loads C's admitted variant at CFO < 0.5 and recomputes the
    first ceil(CFO |C|) tokens of its ranking. Negative control: admission off, no variant appears and
    every non-first chunk stays at the base variant's 0.5."""
    case = make_case(adapter.shape.vocab_size, seed=31)
    engine = make_engine(adapter, CacheFuseConfig(selector="cachecraft", cachecraft_early_termination=False))
    precompute_case(engine, case, with_hole=False)  # base variants only, as offline precompute leaves them
    key_a, key_b, key_c = (engine.key(p) for p in case.pieces)
    first, second, third = served(engine, case, [[0, 1, 2], [0, 1, 2], [0, 1, 2]])
    assert first.chunk_cfo == [0.0, 0.0, None, 0.5] and first.holes_saved == 1  # B: tie with C, the earlier
    assert second.chunk_cfo == [0.0, 0.0, 0.0, None] and second.holes_saved == 1  # B reused exactly; C admitted
    assert third.chunk_cfo == [0.0, 0.0, 0.0, 0.0] and third.holes_saved == 0  # nothing left to admit
    by_chunk = {r.chunk_key: r for r in fused_variants(engine)}
    assert by_chunk[key_b].prefix == (key_a,) and by_chunk[key_c].prefix == (key_a, key_b)
    variant_c = by_chunk[key_c]
    assert variant_c.has_stats and variant_c.ranked_tokens and len(fused_variants(engine)) == 2

    ids, chunks = prompt(case, [0, 2])  # C after A alone: a related prefix
    result, related = engine.prefill(ids, chunks, save_inline=True)
    expected, _ = scores.score_variant(variant_c.to_variant(), (key_a,), alpha=1.0)
    assert related.chunk_cfo[2] == pytest.approx(expected) and 0.0 < expected < 0.5 and related.holes_saved == 0
    start_c = chunks[2][0]
    rows_c = [int(r) - start_c for r in result.rows_per_layer[0] if start_c <= int(r) < chunks[2][1]]
    assert sorted(rows_c) == sorted(variant_c.ranked_tokens[:math.ceil(expected * len(case.pieces[2]))])

    control = make_engine(adapter, CacheFuseConfig(selector="cachecraft", cachecraft_early_termination=False,
                                                   variant_admission_max_chunks=0))
    precompute_case(control, case, with_hole=False)
    for stats in served(control, case, [[0, 1, 2], [0, 1, 2], [0, 2]]):
        assert stats.chunk_cfo[2:] == [0.5] * (len(stats.chunk_cfo) - 2) and stats.holes_saved == 0
    assert fused_variants(control) == []


def test_admission_never_exceeds_max_variants(adapter):
    """N x M bounds admitted variants too: each admission that finds the store full evicts the lowest f_r."""
    case = make_case(adapter.shape.vocab_size, seed=32)
    engine = make_engine(adapter, CacheFuseConfig(selector="cachecraft", max_variants=6))
    precompute_case(engine, case, with_hole=False)  # 4 variants: the system, A, B, C
    orders = [[0, 1, 2], [2, 1, 0], [1, 0, 2], [0, 2, 1], [2, 0, 1], [1, 2, 0]] * 2
    evicted = 0
    for stats in served(engine, case, orders):
        assert engine.metastore.count() <= 6
        evicted += len(stats.evicted_variants)
    assert evicted > 0 and len(fused_variants(engine)) >= 1


def test_admission_leaves_chunks_served_as_exact_alone(adapter):
    """The system chunk and the first chunk after it reuse K/V computed for exactly this context: even the
    most eager policy (threshold 0, no limit) loads them, and the answer equals the full prefill's.
    Negative control: the same policy computes B (a base variant after A) in full."""
    case = make_case(adapter.shape.vocab_size, seed=33)
    eager = make_engine(adapter, CacheFuseConfig(selector="cachecraft", variant_admission_cfo=0.0,
                                                 variant_admission_max_chunks=99))
    precompute_case(eager, case, with_hole=False)
    ids, chunks = prompt(case, [0])
    result, stats = eager.prefill(ids, chunks, save_inline=True)
    full, _ = eager.prefill(ids, chunks, selector="full_prefill", save_holes=False, variants=[None, None])
    assert stats.chunk_cfo == [0.0, 0.0] and stats.holes_saved == 0 and stats.tokens_recomputed == len(case.question)
    torch.testing.assert_close(result.logits, full.logits, **TOL[torch.float32])
    _, control = eager.prefill(*prompt(case, [0, 1]), save_inline=True)
    assert control.chunk_cfo == [0.0, 0.0, None] and control.holes_saved == 1

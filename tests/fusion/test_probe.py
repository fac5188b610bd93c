"""The question probe and the query-aware selectors (fusionrag, qcfuse) on tiny models.

- ratio 0 equals full reuse exactly, ratio 1 full prefill (tests/fusion/test_fusor.py runs both selectors
  through every family); an intermediate ratio differs from both (negative control);
- the full-view probe's scores equal the question's softmax attention computed from the tensors of an
  independent full-reuse pass (captured in its attention calls);
- the probe stops at the deepest score layer; anchors are ceil(r_a |c|) and keep the first tokens;
  an anchor view with every token equals the full view, a 10% one does not;
- the probe's cost is reported, and the probe never writes a stored tensor.
"""

from __future__ import annotations

import math

import pytest
import torch

from cachefuse.attention import rows_attention, rows_attention_at
from cachefuse.chunks import segment_prompt
from cachefuse.config import CacheFuseConfig
from cachefuse.errors import ConfigError
from cachefuse.fusion.fusor import Fusor
from cachefuse.fusion.plan import FuseRequest
from cachefuse.fusion.probe import question_rows, run_probe
from cachefuse.select.base import ProbeSpec
from cachefuse.select.qcfuse import (
    ANCHORS_META,
    anchor_count,
    anchors_from_meta,
    anchors_meta,
    critical_layer_indices,
    default_critical_layers,
    key_norm_scores,
    rank_anchors,
)
from cachefuse.select.registry import make_selector
from tests.helpers.fusion import hole_request_parts, make_engine

TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def loaded_case(adapter):
    """A precomputed case (system, A, C stored; B a hole) and its FuseRequest parts."""
    return hole_request_parts(adapter, seed=7)


@pytest.mark.parametrize("selector", ["fusionrag", "qcfuse"])
def test_ratio_zero_equals_full_reuse_and_in_between_differs(adapter, loaded_case, selector):
    engine, case, _, _ = loaded_case
    reuse, _ = engine.prefill(case.token_ids, case.chunks, selector="full_reuse", save_holes=False)
    zero, stats = engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.0, save_holes=False)
    torch.testing.assert_close(zero.logits, reuse.logits, atol=0, rtol=0)
    for k_zero, k_reuse in zip(zero.k, reuse.k, strict=True):
        assert torch.equal(k_zero, k_reuse)
    assert stats.num_selected == 0 and stats.probe_layers > 0 and stats.probe_rows == stats.num_forced
    half, _ = engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.5, save_holes=False)
    full, _ = engine.prefill(case.token_ids, case.chunks, selector="full_prefill", save_holes=False)
    assert (half.logits - reuse.logits).abs().max() > 1e-3  # negative controls: the selection matters
    assert (half.logits - full.logits).abs().max() > 1e-3


def test_full_view_scores_equal_attention_of_a_full_reuse_pass(adapter, loaded_case):
    """Independent of cachefuse.fusion.probe: the full-reuse pass computes the same forced rows over the same
    K/V; its attention calls are captured and the question's softmax weights recomputed by hand."""
    engine, case, segments, loaded = loaded_case
    ids = torch.tensor(case.token_ids)
    captured: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def capture(q, q_positions, k, v, scale, block_rows):
        captured.append((q.clone(), q_positions.clone(), k.clone()))
        return rows_attention(q, q_positions, k, v, scale, block_rows)

    Fusor(adapter, attention_fn=capture).fuse(FuseRequest(ids, segments, loaded, 0.0), make_selector(
        "full_reuse", CacheFuseConfig()))
    num_layers, scale = adapter.shape.num_layers, adapter.shape.scaling
    request = FuseRequest(ids, segments, loaded, 0.15)
    from cachefuse.fusion.fusor import _RequestLayout

    layout = _RequestLayout(request, num_layers, adapter.device)
    spec = ProbeSpec((1, num_layers - 2))  # the pass's last layer attends from the last row only
    probe = run_probe(adapter, ids, segments, loaded, layout.forced_rows, layout.ctx, spec, {})

    question = question_rows(segments, len(ids))
    expected = torch.zeros(len(ids))
    for layer in spec.score_layers:
        q, q_positions, k = captured[layer]
        assert torch.equal(q_positions, layout.forced_rows)
        q_question = q[torch.searchsorted(q_positions, question)]
        k_heads = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # GQA
        logits = torch.einsum("rhd,khd->hrk", q_question, k_heads) * scale
        visible = torch.arange(len(ids))[None, :] <= question[:, None]
        expected += torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).sum(dim=(0, 1))
    torch.testing.assert_close(probe.scores, expected[layout.ctx.candidate_rows], **TOL)
    assert probe.num_layers_run == num_layers - 1 and probe.num_view_rows == sum(e.num_tokens for e in loaded.values())


class CountingAdapter:
    """Forwards to an adapter and records the layers whose Q/K/V were projected."""

    def __init__(self, inner):
        self.inner, self.layers = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def project_qkv(self, layer, x):
        self.layers.append(layer)
        return self.inner.project_qkv(layer, x)


def test_probe_stops_at_the_deepest_critical_layer(adapter, loaded_case):
    engine, case, segments, loaded = loaded_case
    num_layers = adapter.shape.num_layers
    config = CacheFuseConfig(selector="qcfuse", qcfuse_critical_layers=(1, 2))
    counting = CountingAdapter(adapter)
    fusor = Fusor(counting)
    result = fusor.fuse(FuseRequest(torch.tensor(case.token_ids), segments, loaded, 0.15),
                        make_selector("qcfuse", config))
    assert result.probe_layers == 3
    assert counting.layers[:3] == [0, 1, 2]  # the probe
    assert counting.layers[3:] == list(range(num_layers))  # then the blend pass, no full layers
    assert result.probe_rows == result.num_forced


def test_anchor_view_with_every_token_equals_the_full_view(adapter, loaded_case):
    engine, case, segments, loaded = loaded_case
    ids, num_layers = torch.tensor(case.token_ids), adapter.shape.num_layers
    from cachefuse.fusion.fusor import _RequestLayout

    layout = _RequestLayout(FuseRequest(ids, segments, loaded, 0.15), num_layers, torch.device("cpu"))
    layers = (1, num_layers - 1)
    every = {i: torch.arange(segments[i].length) for i in loaded if not segments[i].is_system}
    full = run_probe(adapter, ids, segments, loaded, layout.forced_rows, layout.ctx, ProbeSpec(layers), {})
    same = run_probe(adapter, ids, segments, loaded, layout.forced_rows, layout.ctx,
                     ProbeSpec(layers, anchors_only=True), every)
    torch.testing.assert_close(same.scores, full.scores, **TOL)
    tenth = {i: rank_anchors(key_norm_scores(loaded[i].k_nope), 0.1, 1) for i in every}
    sparse = run_probe(adapter, ids, segments, loaded, layout.forced_rows, layout.ctx,
                       ProbeSpec(layers, anchors_only=True), tenth)
    assert (sparse.scores - full.scores).abs().max() > 1e-4  # negative control: the view matters
    assert sparse.num_view_rows == len(case.system) + sum(t.numel() for t in tenth.values())


def test_rows_attention_at_sees_only_the_view_keys_up_to_each_row():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(7, 4, 8, generator=g), torch.randn(30, 2, 8, generator=g), torch.randn(30, 2, 8, generator=g)
    rows = torch.tensor([3, 9, 10, 17, 22, 28, 29])
    keep = torch.tensor([0, 2, 3, 9, 10, 15, 17, 22, 28, 29])  # a view: rows 3.. see only these keys
    masked = torch.zeros(30, dtype=torch.bool)
    masked[keep] = True
    expected = rows_attention(q, rows, k.masked_fill(~masked[:, None, None], 0), v, 0.3)  # not the same: zeros
    got = rows_attention_at(q, rows, k[keep], v[keep], keep, 0.3, block_rows=2)
    assert not torch.allclose(got, expected)  # dropped keys are absent, not zero keys
    for i, p in enumerate(rows.tolist()):
        sub = keep[keep <= p]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[i:i + 1].transpose(0, 1)[None], k[sub].transpose(0, 1)[None], v[sub].transpose(0, 1)[None],
            scale=0.3, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(got[i:i + 1], ref)


@pytest.mark.parametrize("num_tokens,ratio", [(1, 0.1), (9, 0.1), (10, 0.1), (11, 0.1), (30, 0.1), (57, 0.25)])
def test_anchor_count_and_sinks(num_tokens, ratio):
    scores = torch.arange(num_tokens, dtype=torch.float32)  # later tokens rank higher
    anchors = rank_anchors(scores, ratio, sink_tokens=1)
    assert anchors.numel() == anchor_count(num_tokens, ratio) == max(1, math.ceil(ratio * num_tokens - 1e-9))
    assert int(anchors[0]) == 0 and torch.equal(anchors, anchors.sort().values)
    if anchors.numel() > 1:
        assert anchors[1:].tolist() == list(range(num_tokens - anchors.numel() + 1, num_tokens))


def test_anchors_round_trip_through_metadata_and_damage_is_a_miss():
    offsets = torch.tensor([0, 4, 7])
    meta = {ANCHORS_META: anchors_meta(offsets, "attention", 0.1, 1)}
    assert torch.equal(anchors_from_meta(meta, 30, 0.1, 1), offsets)
    assert anchors_from_meta(meta, 30, 0.2, 1) is None  # chosen for another ratio
    assert anchors_from_meta(meta, 5, 0.1, 1) is None  # does not fit the chunk
    for damaged in ("{", '{"offsets": "x"}', '{"ranking": 1, "ratio": 0.1, "sink_tokens": 1, "offsets": [0, 99, 1]}'):
        assert anchors_from_meta({ANCHORS_META: damaged}, 30, 0.1, 1) is None


def test_stored_anchors_are_used(adapter, loaded_case):
    engine, case, segments, loaded = loaded_case
    selector = make_selector("qcfuse", CacheFuseConfig())
    index = 3
    derived = selector.probe_anchors(segments[index], loaded[index].k_nope, {})
    assert torch.equal(derived, rank_anchors(key_norm_scores(loaded[index].k_nope), 0.1, 1))
    other = torch.tensor([0, 5, 6, 30][:anchor_count(segments[index].length, 0.1)])
    meta = {ANCHORS_META: anchors_meta(other, "attention", 0.1, 1)}
    assert torch.equal(selector.probe_anchors(segments[index], loaded[index].k_nope, meta), other)


def test_score_layer_configurations():
    assert default_critical_layers(30) == (16, 17, 18)
    assert default_critical_layers(2) == (0, 1)
    assert critical_layer_indices((-1, 3, 3), 8) == (3, 7)
    with pytest.raises(ValueError, match="qcfuse_critical_layers"):
        critical_layer_indices((8,), 8)
    last = make_selector("qcfuse", CacheFuseConfig(qcfuse_layers="last")).probe_spec(8)
    every = make_selector("qcfuse", CacheFuseConfig(qcfuse_layers="all", qcfuse_view="full")).probe_spec(8)
    assert last == ProbeSpec((7,), anchors_only=True) and every == ProbeSpec(tuple(range(8)), anchors_only=False)
    assert make_selector("fusionrag", CacheFuseConfig()).probe_spec(8) == ProbeSpec((7,))


@pytest.mark.parametrize("field,value", [
    ("fusionrag_score_layers", 0), ("qcfuse_anchor_ratio", 0.0), ("qcfuse_anchor_ratio", 1.5),
    ("qcfuse_sink_tokens", -1), ("qcfuse_layers", "middle"), ("qcfuse_critical_layers", ()),
    ("qcfuse_critical_layers", ("a",)), ("qcfuse_view", "half"),
])
def test_bad_query_aware_config_names_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        CacheFuseConfig(**{field: value})


def test_layers_beyond_the_model_fail_at_start_up(adapter, loaded_case):
    engine, case, _, _ = loaded_case
    num_layers = adapter.shape.num_layers
    for config in (CacheFuseConfig(qcfuse_critical_layers=(num_layers,)),
                   CacheFuseConfig(qcfuse_critical_layers=(-num_layers - 1,)),
                   CacheFuseConfig(cacheblend_check_layers=(num_layers - 1,))):  # the last layer: ignored
        with pytest.raises(ConfigError, match="the model has"):
            make_engine(adapter, config)
    make_engine(adapter, CacheFuseConfig(qcfuse_critical_layers=(-num_layers, num_layers - 1),
                                         cacheblend_check_layers=(1, num_layers - 2), cacheblend_ratio_schedule=(1.5, 1.0)))
    selector = make_selector("qcfuse", CacheFuseConfig(qcfuse_critical_layers=(99,)))  # a ready instance
    with pytest.raises(ValueError, match="qcfuse_critical_layers"):
        engine.prefill(case.token_ids, case.chunks, selector=selector, save_holes=False)


def test_probe_never_writes_stored_tensors(adapter, loaded_case):
    engine, case, _, loaded = loaded_case
    before = {i: [k.clone() for k in e.k_nope] + [v.clone() for v in e.v] for i, e in loaded.items()}
    for selector in ("fusionrag", "qcfuse"):
        engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.3, save_holes=False)
    for i, entry in loaded.items():
        for a, b in zip(before[i], [*entry.k_nope, *entry.v], strict=True):
            assert torch.equal(a, b)


def test_probe_attends_to_the_last_position_once_when_the_prompt_ends_inside_a_loaded_chunk(adapter):
    """The last token is a forced row, computed afresh; when it lies inside a loaded chunk the probe must
    leave that row's loaded K/V out. Its scores then equal those of the same prompt with the chunk
    declared one token shorter (the same loaded K/V, bit for bit); with position N-1 attended twice they
    did not."""
    from cachefuse.fusion.fusor import _RequestLayout
    from tests.fusion.test_fusor import ends_inside_and_shorter

    engine, case, shorter_chunks = ends_inside_and_shorter(adapter)
    ids = torch.tensor(case.token_ids)
    scores = []
    for chunks in (case.chunks, shorter_chunks):
        segments = segment_prompt(len(ids), chunks)
        loaded = {i: engine.store.get(engine.key(case.token_ids[s.start:s.end], at_prompt_start=s.is_system))
                  for i, s in enumerate(segments) if s.is_chunk}
        layout = _RequestLayout(FuseRequest(ids, segments, loaded, 0.2), adapter.shape.num_layers, adapter.device)
        spec = ProbeSpec((1, adapter.shape.num_layers - 1))
        probe = run_probe(adapter, ids, segments, loaded, layout.forced_rows, layout.ctx, spec, {})
        scores.append(probe.scores)
        assert probe.num_view_rows == len(ids) - 1  # every loaded row but the last token's
    assert torch.equal(scores[0], scores[1])


def _tail_kv_over(adapter, ids: list[int], positions: list[int], past_k, past_v, tail: int):
    """transformers' own K/V of the last `tail` of `ids` (at `positions`) after a cache holding `past_k/v`
    for the ids before them (None: no cache, every id is fed): [layers] of ([tail, kv_heads, dim], ...)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    if past_k is not None:
        cache = DynamicCache(ddp_cache_data=[(k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous())
                                             for k, v in zip(past_k, past_v, strict=True)])
        ids, positions = ids[-tail:], positions[-tail:]
    with torch.inference_mode():
        adapter.model(torch.tensor([ids]), position_ids=torch.tensor([positions]), past_key_values=cache,
                      use_cache=True)
    return [(layer.keys[0, :, -tail:].transpose(0, 1), layer.values[0, :, -tail:].transpose(0, 1))
            for layer in cache.layers]


@pytest.mark.parametrize("setting", ["fusionrag", "qclast"])
def test_question_rows_continue_from_the_fused_context_not_the_probes_view(adapter, loaded_case, setting):
    """Issue 30 item 6: what decoding continues from after a query-aware pass. The question rows' and the
    last token's K/V in the fused result (what `greedy_continuation` and vLLM decode over) are transformers'
    own forward of those tokens after the fused K/V of every row before them, in every layer: the probe's
    K/V, computed over its own view, are not left behind. Negative control: the probe's own K/V of the tail
    differ from them (fusionrag's full view: full reuse's pass; the question-only view: transformers over the
    compact [system, hole, question] sequence at the request's positions), so a pass that kept the probe's
    rows would fail the first assertion."""
    engine, case, segments, _ = loaded_case
    fields = {"qcfuse_layers": "last", "qcfuse_view": "question_only"} if setting == "qclast" else {}
    selector = make_selector("qcfuse" if setting == "qclast" else setting, CacheFuseConfig().replace(**fields))
    fused, stats = engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.3, save_holes=False)
    assert 0 < fused.num_selected < fused.num_candidates
    start = segments[-1].start  # the question: every row after the last declared chunk
    tail = len(case.token_ids) - start
    expected = _tail_kv_over(adapter, case.token_ids, list(range(len(case.token_ids))),
                             [k[:start] for k in fused.k], [v[:start] for v in fused.v], tail)
    for (k, v), k_fused, v_fused in zip(expected, fused.k, fused.v, strict=True):
        torch.testing.assert_close(k_fused[start:], k, **TOL)
        torch.testing.assert_close(v_fused[start:], v, **TOL)

    if setting == "fusionrag":  # its probe's view is every loaded row: full reuse's pass, up to its depth
        reuse, _ = engine.prefill(case.token_ids, case.chunks, selector="full_reuse", save_holes=False)
        probes_own = [(k[start:], v[start:]) for k, v in zip(reuse.k, reuse.v, strict=True)]
    else:
        hole = segments[2]
        view = list(range(case.chunks[0][1])) + list(range(hole.start, hole.end)) + list(
            range(start, len(case.token_ids)))  # system, the hole (a forced row), the question
        probes_own = _tail_kv_over(adapter, [case.token_ids[p] for p in view], view, None, None, tail)
    deepest = max((k_fused[start:] - k).abs().max() for (k, _), k_fused in zip(probes_own, fused.k, strict=True))
    assert deepest > 1e-3

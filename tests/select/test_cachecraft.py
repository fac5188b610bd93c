"""cachecraft: per-chunk counts and Eq. 14 order from the variant metadata, CFO 1.0 equals full prefill,
and focused-chunk early termination in the blend pass (the question mass it sees is checked against an
explicit softmax and against transformers' own attention weights)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from cachefuse import rope
from cachefuse.adapters.hf import HFAdapter
from cachefuse.attention import rows_attention
from cachefuse.chunks import Segment, segment_prompt
from cachefuse.config import CacheFuseConfig
from cachefuse.fusion.fusor import Fusor
from cachefuse.fusion.plan import FuseRequest, FuseResult
from cachefuse.select.base import ChunkReuse, PlannedChunk, RowEstimate, SelectionContext
from cachefuse.select.cachecraft import CacheCraftSelector
from cachefuse.select.registry import make_selector
from tests.helpers.fusion import make_case, make_engine
from tests.helpers.tolerances import TOL

CHUNK_A, CHUNK_C = 1, 3  # segment indices of the loaded candidate chunks; 2 (B) is a hole, 4 the question


# --------------------------------------------------------------------------- selector alone


SEGMENTS = (
    Segment(0, 10, is_chunk=True, is_system=True),
    Segment(10, 37, is_chunk=True, is_system=False),
    Segment(47, 50, is_chunk=True, is_system=False),
    Segment(97, 13, is_chunk=False, is_system=False),
)


def make_ctx(ratio: float, reuse=None, segments=SEGMENTS) -> SelectionContext:
    candidates = [s for s in segments if s.is_chunk and not s.is_system]
    num_tokens = segments[-1].end
    rows = torch.cat([torch.arange(s.start, s.end) for s in candidates])
    rows = rows[rows != num_tokens - 1]
    return SelectionContext(num_tokens=num_tokens, num_layers=8, segments=segments, candidate_rows=rows,
                            candidate_segments=tuple(candidates), ratio=ratio, reuse=reuse or {})


def rows_in(rows: torch.Tensor, seg: Segment) -> list[int]:
    return [r - seg.start for r in rows.tolist() if seg.start <= r < seg.end]


def test_registry_builds_from_config():
    config = CacheFuseConfig(selector="cachecraft", force_cfo=0.25, cachecraft_window=2,
                             cachecraft_early_termination=False)
    selector = make_selector("cachecraft", config)
    assert isinstance(selector, CacheCraftSelector) and selector.name == "cachecraft"
    assert (selector.force_cfo, selector.window, selector.early_termination) == (0.25, 2, False)
    assert selector.num_full_layers(8) == 0 and selector.check_layers(8) == ()
    assert not selector.tracks_question_attention()
    assert make_selector("cachecraft", CacheFuseConfig()).tracks_question_attention()


def test_counts_and_order_from_metadata():
    ranked = (36, 0, 5, 5, 17, 2)  # a duplicate is skipped; a short ranking continues with offsets 1, 3, ...
    reuse = {1: ChunkReuse(cfo=0.2, ranked_tokens=ranked, variant_id="v1"), 2: ChunkReuse(cfo=0.1)}
    rows = CacheCraftSelector().initial_rows(make_ctx(0.5, reuse))
    assert torch.equal(rows, rows.sort().values) and rows.dtype == torch.int64
    assert sorted(rows_in(rows, SEGMENTS[1])) == sorted([36, 0, 5, 17, 2, 1, 3, 4])  # ceil(0.2 * 37) = 8
    assert rows_in(rows, SEGMENTS[2]) == list(range(5))  # ceil(0.1 * 50) = 5, no ranking: the first tokens


def test_chunk_without_metadata_uses_the_ratio_and_force_overrides():
    reuse = {1: ChunkReuse(cfo=0.2, ranked_tokens=tuple(range(36, -1, -1)))}
    rows = CacheCraftSelector().initial_rows(make_ctx(0.3, reuse))
    assert rows_in(rows, SEGMENTS[1]) == list(range(29, 37))  # ceil(0.2 * 37) = 8, from the ranking
    assert rows_in(rows, SEGMENTS[2]) == list(range(15))  # no metadata: ceil(0.3 * 50) = 15
    forced = CacheCraftSelector(force_cfo=0.15).initial_rows(make_ctx(0.3, reuse))
    assert rows_in(forced, SEGMENTS[1]) == list(range(31, 37))  # ceil(0.15 * 37) = 6, still ranked
    assert len(rows_in(forced, SEGMENTS[2])) == math.ceil(0.15 * 50 - 1e-9) == 8


@pytest.mark.parametrize(("reuse", "ratio", "force_cfo"), [
    ({1: ChunkReuse(0.2, (36, 0, 5)), 2: ChunkReuse(0.1)}, 0.5, None),  # every chunk has a CFO: 8 + 5
    ({1: ChunkReuse(0.2)}, 0.3, None),  # the second chunk without metadata follows the ratio: 8 + 15
    ({1: ChunkReuse(0.2), 2: ChunkReuse(0.9)}, 0.3, 0.15),  # forced: 6 + 8
    ({1: ChunkReuse(1.0), 2: ChunkReuse(0.0)}, 0.3, None),  # every row of one chunk, none of the other
])
def test_estimated_rows_are_the_rows_it_picks(reuse, ratio, force_cfo):
    """What the loading controller is told before the pass (from the chunks' lengths and CFOs) is what
    initial_rows then picks: ceil(CFO x tokens) per chunk, not ratio x tokens."""
    selector = CacheCraftSelector(force_cfo=force_cfo)
    chunks = [PlannedChunk(SEGMENTS[i].length, reuse[i].cfo if i in reuse else None) for i in (1, 2)]
    estimate = selector.estimate_rows(chunks, 8)
    picked = selector.initial_rows(make_ctx(ratio, reuse)).numel()
    assert estimate.num_planned_rows + math.ceil(ratio * estimate.num_ratio_candidates - 1e-9) == picked
    if force_cfo is None and len(reuse) == 2:
        assert estimate.num_ratio_candidates == 0  # no row depends on the ratio
    assert selector.estimate_rows([], 8) == RowEstimate(0, 0)


def test_last_token_is_never_selected():
    segments = (Segment(0, 4, True, True), Segment(4, 10, True, False))  # the prompt ends inside a chunk
    reuse = {1: ChunkReuse(cfo=1.0, ranked_tokens=(9, 8, 7))}
    rows = CacheCraftSelector().initial_rows(make_ctx(0.0, reuse, segments))
    assert rows.tolist() == list(range(4, 13))  # 9 candidates: ceil(1.0 * 10) capped
    assert CacheCraftSelector(force_cfo=0.0).initial_rows(make_ctx(0.5, reuse, segments)).numel() == 0


def test_after_layer_drops_unfocused_chunks_once():
    ctx = make_ctx(0.2)
    selector = CacheCraftSelector(window=2)
    rows = selector.initial_rows(ctx)
    assert selector.focused_segments == (1, 2) and selector.focus_layer is None
    mass = torch.tensor([3.0, 0.9, 0.1, 9.0])  # [segments]: system and question are not chunks
    assert selector.after_layer(ctx, 0, mass) is None  # one layer seen, window 2
    kept = selector.after_layer(ctx, 1, mass)
    assert kept.tolist() == [r for r in rows.tolist() if r < 47]  # chunk 2 (segment 2) unfocused
    assert selector.focus_layer == 1 and selector.focused_segments == (1,)
    assert selector.after_layer(ctx, 2, torch.tensor([0.0, 0.0, 5.0, 0.0])) is None


def test_after_layer_all_focused_keeps_rows():
    ctx = make_ctx(0.2)
    selector = CacheCraftSelector(window=1)
    selector.initial_rows(ctx)
    assert selector.after_layer(ctx, 0, torch.tensor([1.0, 0.5, 0.5, 1.0])) is None  # equal: all focused
    assert selector.focus_layer == 0 and selector.focused_segments == (1, 2)


# --------------------------------------------------------------------------- the blend pass


@pytest.fixture(scope="module")
def rag(tiny_model_dir):
    """A tiny llama, a prompt | system | A | B (hole) | C | question | and the loaded system, A and C."""
    path = str(tiny_model_dir("llama"))
    adapter = HFAdapter.from_pretrained(path)
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=11)
    loaded = {0: engine.compute_chunk(case.system), CHUNK_A: engine.compute_chunk(case.pieces[0], case.system),
              CHUNK_C: engine.compute_chunk(case.pieces[2], case.system)}
    segments = segment_prompt(len(case.token_ids), case.chunks)
    return path, adapter, case, segments, loaded


def fuse(rag, selector, ratio=0.2, reuse=None, attention_fn=None) -> FuseResult:
    _, adapter, case, segments, loaded = rag
    fusor = Fusor(adapter) if attention_fn is None else Fusor(adapter, attention_fn=attention_fn)
    request = FuseRequest(torch.tensor(case.token_ids), segments, loaded, ratio, reuse=reuse or {})
    return fusor.fuse(request, selector)


def test_cfo_one_equals_full_prefill(rag):
    adapter = rag[1]
    expected = fuse(rag, make_selector("full_prefill", CacheFuseConfig()))
    result = fuse(rag, CacheCraftSelector(force_cfo=1.0, early_termination=False), ratio=0.0)
    tol = TOL[adapter.shape.dtype]
    torch.testing.assert_close(result.logits, expected.logits, **tol)
    for layer in range(adapter.shape.num_layers):
        torch.testing.assert_close(result.k[layer], expected.k[layer], **tol)
        torch.testing.assert_close(result.v[layer], expected.v[layer], **tol)
    assert result.num_selected == result.num_candidates

    half = fuse(rag, CacheCraftSelector(force_cfo=0.5, early_termination=False))  # negative control
    assert (half.logits - expected.logits).abs().max() > 100 * tol["atol"]


@pytest.mark.parametrize("cfo", [0.3, 0.07])
def test_forced_cfo_rows_per_chunk(rag, cfo):
    segments = rag[3]
    g = torch.Generator().manual_seed(1)
    ranked_a = tuple(torch.randperm(segments[CHUNK_A].length, generator=g).tolist())
    reuse = {CHUNK_A: ChunkReuse(cfo=0.9, ranked_tokens=ranked_a)}  # C: no metadata, no ranking
    result = fuse(rag, CacheCraftSelector(force_cfo=cfo, early_termination=False), reuse=reuse)
    for rows in result.rows_per_layer:
        for index in (CHUNK_A, CHUNK_C):
            n = math.ceil(cfo * segments[index].length)
            picked = rows_in(rows, segments[index])
            expected = sorted(ranked_a[:n]) if index == CHUNK_A else list(range(n))
            assert picked == expected
    assert result.num_selected == sum(math.ceil(cfo * segments[i].length) for i in (CHUNK_A, CHUNK_C))


def test_per_chunk_cfo_from_reuse(rag):
    segments = rag[3]
    reuse = {CHUNK_A: ChunkReuse(cfo=0.5), CHUNK_C: ChunkReuse(cfo=0.1, ranked_tokens=(30, 29, 28, 27))}
    result = fuse(rag, CacheCraftSelector(early_termination=False), ratio=0.9, reuse=reuse)
    rows = result.rows_per_layer[0]
    assert rows_in(rows, segments[CHUNK_A]) == list(range(math.ceil(0.5 * segments[CHUNK_A].length)))
    assert rows_in(rows, segments[CHUNK_C]) == [27, 28, 29, 30]  # ceil(0.1 * 31) = 4
    assert all(torch.equal(r, rows) for r in result.rows_per_layer)


class RecordingCacheCraft(CacheCraftSelector):
    """Keeps the question mass the fusor passes at each layer."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.question_mass: dict[int, torch.Tensor] = {}

    def after_layer(self, ctx, layer, question_mass):
        self.question_mass[layer] = question_mass.clone()
        return super().after_layer(ctx, layer, question_mass)


def explicit_question_mass(q, q_positions, k, segments, question_start, scale) -> torch.Tensor:
    """softmax(q k^T) of the question rows over the merged K, summed per segment and row, mean over heads."""
    is_question = q_positions >= question_start
    q, q_positions = q[is_question].float(), q_positions[is_question]
    k = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [num_tokens, num_heads, head_dim]
    scores = torch.einsum("rhd,khd->hrk", q, k) * scale
    future = torch.arange(k.shape[0])[None, None, :] > q_positions[None, :, None]
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)  # [heads, rows, keys]
    return torch.stack([probs[:, :, s.start:s.end].sum(dim=(1, 2)) for s in segments], dim=1).mean(dim=0)


@pytest.mark.parametrize("window", [1, 2])
def test_early_termination_drops_unfocused_chunks(rag, window):
    _, adapter, case, segments, loaded = rag
    num_layers, question_start = adapter.shape.num_layers, segments[-1].start
    calls = []

    def attention(q, q_positions, k, v, scale, block_rows):
        calls.append((q.clone(), q_positions.clone(), k.clone()))
        return rows_attention(q, q_positions, k, v, scale, block_rows)

    selector = RecordingCacheCraft(force_cfo=0.3, window=window)
    result = fuse(rag, selector, attention_fn=attention)

    assert sorted(selector.question_mass) == list(range(num_layers - 1))  # not after the last layer
    for layer, mass in selector.question_mass.items():
        q, q_positions, k = calls[layer]  # rows continuing past `layer`, the question among them
        expected = explicit_question_mass(q, q_positions, k, segments, question_start, adapter.shape.scaling)
        torch.testing.assert_close(mass, expected, atol=1e-5, rtol=1e-5)
        assert abs(float(mass.sum()) - (len(case.token_ids) - question_start)) < 1e-3  # each row sums to 1

    n = {i: math.ceil(0.3 * segments[i].length) for i in (CHUNK_A, CHUNK_C)}
    if window == 1:
        assert selector.focus_layer == 0
    if selector.focus_layer is None:  # window 2 on this model may never stabilise: every chunk focused
        assert selector.focused_segments == (CHUNK_A, CHUNK_C) and result.num_selected == sum(n.values())
        return
    (focused,) = selector.focused_segments  # two chunks of different mass: the gap rule keeps one
    (unfocused,) = {CHUNK_A, CHUNK_C} - {focused}
    cinter = sum(selector.question_mass[layer] for layer in range(selector.focus_layer + 1))
    assert cinter[focused] > cinter[unfocused]
    for layer, rows in enumerate(result.rows_per_layer):
        assert len(rows_in(rows, segments[focused])) == n[focused]
        assert len(rows_in(rows, segments[unfocused])) == (n[unfocused] if layer <= selector.focus_layer else 0)
    assert result.num_selected == n[focused]

    seg = segments[unfocused]  # Fig. 16: later layers keep the loaded K/V, re-rotated
    positions = torch.arange(seg.start, seg.end)
    for layer in range(selector.focus_layer + 1, num_layers):
        expected_k = rope.apply_rope(loaded[unfocused].k_nope[layer], positions, adapter.rope_spec)
        assert torch.equal(result.k[layer][seg.start:seg.end], expected_k)
        assert torch.equal(result.v[layer][seg.start:seg.end], loaded[unfocused].v[layer])


def test_question_mass_equals_transformers_attention(rag):
    """At CFO 1.0 the pass is full prefill, so its question mass is the model's own attention weights."""
    path, adapter, case, segments, _ = rag
    selector = RecordingCacheCraft(force_cfo=1.0, window=adapter.shape.num_layers + 1)  # never stable
    fuse(rag, selector)
    assert selector.focus_layer is None and selector.focused_segments == (CHUNK_A, CHUNK_C)
    eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        attentions = eager(torch.tensor([case.token_ids]), output_attentions=True).attentions  # L x [1, H, N, N]
    question_start = segments[-1].start
    for layer, mass in selector.question_mass.items():
        weights = attentions[layer][0, :, question_start:]  # [heads, question rows, keys]
        expected = torch.stack([weights[:, :, s.start:s.end].sum(dim=(1, 2)) for s in segments]).mean(dim=1)
        torch.testing.assert_close(mass, expected, atol=1e-4, rtol=1e-4)

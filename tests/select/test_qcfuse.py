"""qcfuse (cachefuse/select/qcfuse.py): the key-norm anchors every save stores (`choose_anchors`, stored
with `with_anchors` by cachefuse/saving.py) are the ones read back; the demo's baselines QCLast (a
question-only probe, checked against transformers' own forward) and QCAll (the full view). Its top-k of the
probe's scores is ProbeSelector's: tests/select/test_base.py; anchors ranked by received attention and by
KVzip: tests/offline/test_anchors.py."""

import pytest
import torch

from cachefuse.config import CacheFuseConfig
from cachefuse.errors import ConfigError
from cachefuse.fusion.fusor import Fusor, _RequestLayout
from cachefuse.fusion.plan import FuseRequest
from cachefuse.fusion.probe import question_rows, run_probe
from cachefuse.select.base import ProbeSpec
from cachefuse.select.qcfuse import anchors_from_meta, choose_anchors, key_norm_scores, rank_anchors
from cachefuse.select.registry import make_selector
from cachefuse.store.base import ChunkKV
from tests.helpers.fusion import hole_request_parts, make_case, make_engine

pytestmark = pytest.mark.tiny_model("llama", num_layers=3)  # the shared `adapter` (tests/conftest.py)


def test_every_saved_entry_carries_key_norm_anchors_by_default(adapter):
    """Precompute and hole saves store the key-norm anchors (the serving config's ratio and sinks), so
    a qcfuse request reads them instead of every layer's keys."""
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=9)
    config = engine.config
    engine.precompute([case.pieces[0]], prefix_ids=case.system)
    _, stats = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=0.15, save_inline=True)
    assert len(stats.saved_keys) == 3  # the system chunk and B, C as variants after their prefixes
    for key in [engine.key(case.pieces[0]), *stats.saved_keys]:
        entry = engine.store.get(key)
        assert entry is not None
        stored = anchors_from_meta(entry.meta, entry.num_tokens, config.qcfuse_anchor_ratio,
                                   config.qcfuse_sink_tokens)
        expected = choose_anchors(entry, "key_norm", config.qcfuse_anchor_ratio, config.qcfuse_sink_tokens)
        assert stored is not None and torch.equal(stored, expected)


def test_qclast_and_qcall_are_the_demo_baselines():
    """QCLast: a question-only probe scored at the last layer; QCAll: every loaded row, every layer (the
    QCFuse demo's FusionRAG and ProphetKV). The harness's setting names resolve to these configs."""
    from cachefuse.eval.harness import SELECTOR_VARIANTS

    def spec(fields):
        return make_selector("qcfuse", CacheFuseConfig(**fields)).probe_spec(8)

    assert spec(SELECTOR_VARIANTS["qclast"][1]) == ProbeSpec((7,), question_only=True)
    assert spec(SELECTOR_VARIANTS["qcall"][1]) == ProbeSpec(tuple(range(8)))
    # Negative controls: QCFuse's own view keeps the anchors; its layer ablation keeps them too.
    assert spec({}).anchors_only and not spec({}).question_only
    assert spec(SELECTOR_VARIANTS["qcfuse_last"][1]) == ProbeSpec((7,), anchors_only=True)


def test_qcfuse_view_is_validated_at_start_up():
    assert CacheFuseConfig.from_dict({"qcfuse_view": "question_only", "qcfuse_layers": "last"}).qcfuse_view == \
        "question_only"
    with pytest.raises(ConfigError, match=r"qcfuse_view='context_free' is invalid: expected one of anchors, full, "
                                          r"question_only \(QCLast: question_only with qcfuse_layers last"):
        CacheFuseConfig.from_dict({"qcfuse_view": "context_free"})


def _hf_query_only_scores(model_dir, case, segments, loaded, forced_rows, score_layer):
    """The specification of a question-only probe, from transformers alone: the system prompt and the
    forced rows (hole, question, last) run as one compact sequence at their request positions, so the
    question's hidden states see no retrieved chunk; at `score_layer` its queries attend over every
    loaded key (rotated by transformers' rotary at its request position) and the forced rows' own keys."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    num_tokens, system = len(case.token_ids), segments[0]
    positions = torch.cat([torch.arange(system.end), forced_rows])
    ids = torch.tensor(case.token_ids)[positions]
    with torch.no_grad():
        hidden = model(ids[None], position_ids=positions[None], output_hidden_states=True).hidden_states[score_layer]
        layer = model.model.layers[score_layer]
        x = layer.input_layernorm(hidden)  # [1, T, hidden]
        head_dim = layer.self_attn.head_dim
        q = layer.self_attn.q_proj(x).view(1, len(positions), -1, head_dim).transpose(1, 2)  # [1, H, T, D]
        k = layer.self_attn.k_proj(x).view(1, len(positions), -1, head_dim).transpose(1, 2)  # [1, Hkv, T, D]
        cos, sin = model.model.rotary_emb(x, positions[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k_full = torch.zeros(num_tokens, k.shape[1], head_dim)
        k_full[positions] = k[0].transpose(0, 1)
        for index, entry in loaded.items():  # the loaded rows' keys: the stored ones, rotated in place
            rows = torch.arange(segments[index].start, segments[index].end)
            k_nope = entry.k_nope[score_layer].transpose(0, 1)[None]  # [1, Hkv, rows, D]
            cos_r, sin_r = model.model.rotary_emb(x, rows[None])
            _, k_rot = apply_rotary_pos_emb(k_nope, k_nope, cos_r, sin_r)
            k_full[rows] = k_rot[0].transpose(0, 1)
        question = question_rows(segments, num_tokens)
        q_question = q[0].transpose(0, 1)[torch.searchsorted(positions, question)]  # [R, H, D]
        k_heads = k_full.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        logits = torch.einsum("rhd,khd->hrk", q_question, k_heads) * layer.self_attn.scaling
        visible = torch.arange(num_tokens)[None, :] <= question[:, None]
        return torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).sum(dim=(0, 1))


def test_question_only_probe_equals_a_query_only_forward(adapter, model_dir):
    """QCLast's context-free probe: the question's states come from the system prompt and the forced rows
    alone, and they score every loaded row; checked against transformers' own forward."""
    engine, case, segments, loaded = hole_request_parts(adapter, seed=7)
    ids, num_layers = torch.tensor(case.token_ids), adapter.shape.num_layers
    layout = _RequestLayout(FuseRequest(ids, segments, loaded, 0.15), num_layers, torch.device("cpu"))
    last = num_layers - 1
    probe = run_probe(adapter, ids, segments, loaded, layout.forced_rows, layout.ctx,
                      ProbeSpec((last,), question_only=True), {})
    expected = _hf_query_only_scores(model_dir, case, segments, loaded, layout.forced_rows, last)
    torch.testing.assert_close(probe.scores, expected[layout.ctx.candidate_rows], atol=1e-4, rtol=1e-4)
    assert probe.num_view_rows == len(case.system)  # no retrieved row in the view
    # Negative control: the anchor view conditions the question on the chunks, and scores otherwise.
    anchors = {i: rank_anchors(key_norm_scores(loaded[i].k_nope), 0.1, 1) for i in loaded if not segments[i].is_system}
    anchored = run_probe(adapter, ids, segments, loaded, layout.forced_rows, layout.ctx,
                         ProbeSpec((last,), anchors_only=True), anchors)
    assert (anchored.scores - expected[layout.ctx.candidate_rows]).abs().max() > 1e-4


def test_qclast_reads_no_retrieved_row_below_its_score_layer(adapter):
    """Through the fusor: QCLast's selection is the same whatever the loaded chunks hold below the last
    layer (the question never saw them); QCFuse's anchor view changes with them (negative control)."""
    engine, case, segments, loaded = hole_request_parts(adapter, seed=11)
    ids = torch.tensor(case.token_ids)
    g = torch.Generator().manual_seed(3)
    noisy = {i: e if segments[i].is_system else ChunkKV(
        [k + torch.randn(k.shape, generator=g) if layer < len(e.k_nope) - 1 else k for layer, k in enumerate(e.k_nope)],
        [v + torch.randn(v.shape, generator=g) if layer < len(e.v) - 1 else v for layer, v in enumerate(e.v)], e.meta)
        for i, e in loaded.items()}

    def selected(selector, entries):
        return Fusor(adapter).fuse(FuseRequest(ids, segments, entries, 0.3), selector).rows_per_layer[0]

    qclast = make_selector("qcfuse", CacheFuseConfig(qcfuse_view="question_only", qcfuse_layers="last"))
    assert torch.equal(selected(qclast, loaded), selected(qclast, noisy))
    anchored = make_selector("qcfuse", CacheFuseConfig(qcfuse_layers="last"))
    assert not torch.equal(selected(anchored, loaded), selected(anchored, noisy))

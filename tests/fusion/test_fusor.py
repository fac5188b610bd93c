"""The blend pass pinned at both ends on every family (docs/architecture.md, Invariants).

- ratio 1.0 reproduces the model's own full forward; full reuse differs (negative control);
- full_reuse equals an independent reference: each chunk prefilled alone through transformers,
  re-rotated with transformers' own RoPE code, the hole and question run on top of that cache;
- unselected K/V are exactly the loaded values after re-rotation; forced rows always computed;
- a poisoned future key never reaches an earlier selected row (and would with a bottom-right mask);
- stored tensors are byte-identical after fused requests.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest
import torch
from transformers import DynamicCache

from cachefuse import rope
from cachefuse.adapters.hf import HFAdapter
from cachefuse.attention import rows_attention
from cachefuse.chunks import segment_prompt
from cachefuse.config import CacheFuseConfig
from cachefuse.fusion.fusor import Fusor
from cachefuse.fusion.plan import FuseRequest
from cachefuse.metadata.base import variant_store_key
from cachefuse.select.qcfuse import ANCHORS_META
from cachefuse.select.registry import make_selector
from tests.helpers.fusion import make_case, make_engine, precompute_case
from tests.helpers.models import ALL_FAMILIES
from tests.test_attention import bottom_right_attention

LOGIT_TOL = dict(atol=1e-4, rtol=1e-4)
SELECTIVE = ["cacheblend", "epic", "random", "fusionrag", "qcfuse"]


def model_logits(adapter: HFAdapter, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return adapter.model(torch.tensor([token_ids])).logits[0, -1].float()


def assert_same_greedy(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    top2 = expected.topk(2).values
    if top2[0] - top2[1] > 2 * tol:  # only meaningful where the top-1 margin exceeds the tolerance
        assert actual.argmax() == expected.argmax()


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_full_prefill_selector_equals_model_forward(tiny_adapter, family):
    adapter = tiny_adapter(family)
    ids = make_case(adapter.shape.vocab_size, seed=3).token_ids
    request = FuseRequest(torch.tensor(ids), segment_prompt(len(ids), []), {}, 1.0)
    result = Fusor(adapter).fuse(request, make_selector("full_prefill", CacheFuseConfig()))
    with torch.inference_mode():
        out = adapter.model(torch.tensor([ids]), use_cache=True)
    torch.testing.assert_close(result.logits, out.logits[0, -1].float(), **LOGIT_TOL)
    for layer, cached in enumerate(out.past_key_values.layers):
        torch.testing.assert_close(result.k[layer], cached.keys[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result.v[layer], cached.values[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ALL_FAMILIES)
@pytest.mark.parametrize("selector", SELECTIVE)
def test_ratio_one_equals_full_prefill(tiny_adapter, family, selector):
    adapter = tiny_adapter(family)
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size)
    precompute_case(engine, case)
    result, stats = engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=1.0, save_holes=False)
    expected = model_logits(adapter, case.token_ids)
    torch.testing.assert_close(result.logits, expected, **LOGIT_TOL)
    assert_same_greedy(result.logits, expected, LOGIT_TOL["atol"])
    assert stats.chunks_hit == 3 and stats.chunks_missed == 1  # system, A, C loaded; B a hole

    reuse, _ = engine.prefill(case.token_ids, case.chunks, selector="full_reuse", save_holes=False)
    assert (reuse.logits - expected).abs().max() > 100 * LOGIT_TOL["atol"]  # negative control


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_question_first_and_reordered_chunks_ratio_one(tiny_adapter, family):
    adapter = tiny_adapter(family)
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=5)
    precompute_case(engine, case, with_hole=False)
    c, a = case.pieces[2], case.pieces[0]
    ids = case.system + case.question + c + a  # question before the chunks, chunks swapped
    start_c = len(case.system) + len(case.question)
    chunks = [(0, len(case.system)), (start_c, start_c + len(c)), (start_c + len(c), len(ids))]
    result, stats = engine.prefill(ids + [7], chunks, selector="cacheblend", ratio=1.0, save_holes=False)
    torch.testing.assert_close(result.logits, model_logits(adapter, ids + [7]), **LOGIT_TOL)
    assert stats.chunks_hit == 3


def reference_full_reuse(adapter: HFAdapter, case) -> torch.Tensor:
    """Independent of the fusor: transformers prefills each chunk after the system prompt, its RoPE shifts the
    keys, its own masks (windowed where the model has windows) attend the hole and the question over the
    assembled cache. Caches are plain DynamicCache layers, which keep every key (a model's own sliding-window
    cache drops keys outside the window, and the hole's rows need keys the question's do not)."""
    model, rotary = adapter.model, adapter.decoder.rotary_emb
    apply_rotary = sys.modules[type(adapter.layers[0].self_attn).__module__].apply_rotary_pos_emb
    system, (a, b, c), question = case.system, case.pieces, case.question

    def prefill(ids: list[int]) -> DynamicCache:
        cache = DynamicCache()
        with torch.inference_mode():
            model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
        return cache

    def shifted(keys: torch.Tensor, delta: int) -> torch.Tensor:  # keys [1, H, T, d], post-RoPE
        cos, sin = rotary(keys, torch.full((1, keys.shape[2]), delta))
        return apply_rotary(keys, keys, cos, sin)[1]

    s = len(system)
    cache_a, cache_c = prefill(system + a), prefill(system + c)
    cache = DynamicCache(ddp_cache_data=[(layer.keys.clone(), layer.values.clone()) for layer in cache_a.layers])
    with torch.inference_mode():
        pos_b = torch.arange(s + len(a), s + len(a) + len(b))[None]
        model(torch.tensor([b]), position_ids=pos_b, past_key_values=cache, use_cache=True)  # the hole
        for layer, source in zip(cache.layers, cache_c.layers, strict=True):
            layer.update(shifted(source.keys[:, :, s:], len(a) + len(b)), source.values[:, :, s:])
        start_q = s + len(a) + len(b) + len(c)
        pos_q = torch.arange(start_q, start_q + len(question))[None]
        out = model(torch.tensor([question]), position_ids=pos_q, past_key_values=cache, use_cache=True)
    return out.logits[0, -1].float()


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_full_reuse_equals_independent_reference(tiny_adapter, family):
    adapter = tiny_adapter(family)
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=1)
    precompute_case(engine, case)
    result, stats = engine.prefill(case.token_ids, case.chunks, selector="full_reuse", save_holes=False)
    torch.testing.assert_close(result.logits, reference_full_reuse(adapter, case), **LOGIT_TOL)
    assert stats.num_selected == 0
    assert (result.logits - model_logits(adapter, case.token_ids)).abs().max() > 100 * LOGIT_TOL["atol"]


def test_unselected_rows_are_loaded_values_rerotated(tiny_adapter):
    adapter = tiny_adapter("llama")
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=2)
    precompute_case(engine, case)
    result, _ = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=0.15, save_holes=False)
    segments = segment_prompt(len(case.token_ids), case.chunks)
    loaded = {i: engine.store.get(engine.key(case.token_ids[s.start:s.end], at_prompt_start=s.is_system))
              for i, s in enumerate(segments)}
    full_layers = make_selector("cacheblend", CacheFuseConfig()).num_full_layers(adapter.shape.num_layers)
    checked = 0
    for layer in range(full_layers, adapter.shape.num_layers):
        computed = set(result.rows_per_layer[layer].tolist())
        for index, entry in loaded.items():
            if entry is None:
                continue
            seg = segments[index]
            positions = torch.arange(seg.start, seg.end)
            expected_k = rope.apply_rope(entry.k_nope[layer], positions, adapter.rope_spec)
            for offset, row in enumerate(range(seg.start, seg.end)):
                if row in computed:
                    continue
                assert torch.equal(result.k[layer][row], expected_k[offset])
                assert torch.equal(result.v[layer][row], entry.v[layer][offset])
                checked += 1
    assert checked > 0


@pytest.mark.parametrize("selector", SELECTIVE + ["full_reuse"])
@pytest.mark.parametrize("ratio", [0.0, 0.15, 0.5])
def test_forced_rows_always_computed(tiny_adapter, selector, ratio):
    adapter = tiny_adapter("qwen3")
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=4)
    precompute_case(engine, case)
    result, stats = engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=ratio, save_holes=False)
    b_start, b_end = case.chunks[2]
    question_start = case.chunks[3][1]
    forced = set(range(b_start, b_end)) | set(range(question_start, len(case.token_ids)))
    assert stats.num_forced == len(forced)
    for rows in result.rows_per_layer:
        if rows is not None:
            assert forced <= set(rows.tolist())
            assert rows.numel() <= len(forced) + result.num_candidates
    num_candidates = len(case.pieces[2])  # A, right after the system prompt it was computed after, is exact
    assert result.num_candidates == num_candidates
    if selector in ("cacheblend", "random", "fusionrag", "qcfuse"):
        assert result.num_selected == min(num_candidates, int(torch.tensor(ratio * num_candidates).ceil()))


def test_poisoned_key_after_check_layer_is_invisible(tiny_adapter):
    adapter = tiny_adapter("llama")
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=6)
    precompute_case(engine, case, with_hole=False)
    segments = segment_prompt(len(case.token_ids), case.chunks)
    loaded = {i: engine.store.get(engine.key(case.token_ids[s.start:s.end], at_prompt_start=s.is_system))
              for i, s in enumerate(segments)
              if s.is_chunk}
    poison_at = case.chunks[3][0] + 5  # inside chunk C: rows of chunks A and B must never see it

    def run(attention, poison: bool):
        outputs = []

        def fn(q, q_positions, k, v, scale, block_rows):
            if poison:
                k, v = k.clone(), v.clone()
                k[poison_at], v[poison_at] = 30.0, 1e3
            out = attention(q, q_positions, k, v, scale, block_rows)
            outputs.append((q_positions, out))
            return out

        request = FuseRequest(torch.tensor(case.token_ids), segments, loaded, 0.5)
        Fusor(adapter, attention_fn=fn).fuse(request, make_selector("cacheblend", CacheFuseConfig()))
        return outputs

    for attention, should_hold in ((rows_attention, True), (bottom_right_attention, False)):
        clean, poisoned = run(attention, False), run(attention, True)
        assert len(clean) == adapter.shape.num_layers - 1  # the check layer (continuing rows) and every later one
        holds = all(
            torch.equal(p_out[p_pos < poison_at], c_out[c_pos < poison_at])
            for (c_pos, c_out), (p_pos, p_out) in zip(clean, poisoned, strict=True))
        assert holds is should_hold


def test_stored_tensors_unchanged_by_fused_requests(tiny_adapter):
    adapter = tiny_adapter("qwen2")
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=7)
    precompute_case(engine, case)
    keys = engine.store.keys()
    before = {key: [t.clone() for t in (*engine.store.get(key).k_nope, *engine.store.get(key).v)] for key in keys}
    for selector in ("cacheblend", "epic", "random", "full_reuse", "full_prefill"):
        engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.3, save_holes=False)
    for key in keys:
        entry = engine.store.get(key)
        after = [*entry.k_nope, *entry.v]
        assert all(torch.equal(a, b) for a, b in zip(before[key], after, strict=True))


def test_holes_are_saved_and_hit_next_time(tiny_adapter):
    adapter = tiny_adapter("mistral")
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=8)
    precompute_case(engine, case)
    _, first = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=0.15)
    assert first.chunks_missed == 1 and first.holes_saved == 1
    _, second = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=0.15)
    assert second.chunks_hit == 4 and second.chunks_missed == 0 and second.holes_saved == 0
    hole_key, prefix = engine.key(case.pieces[1]), (engine.key(case.pieces[0]),)
    assert first.saved_keys == (variant_store_key(hole_key, prefix),) and not engine.store.contains(hole_key)
    entry = engine.store.get(first.saved_keys[0])
    assert {k: v for k, v in entry.meta.items() if k != ANCHORS_META} == {"variant": "fused", "prefix": prefix[0]}
    assert ANCHORS_META in entry.meta  # QCFuse's key-norm anchors, written with the entry
    (record,) = engine.metastore.variants(hole_key)  # the variant for its prefix, with its ratio
    assert record.prefix == prefix and record.recompute_ratio == 0.15 and record.access_count == 1
    assert first.saved_variants == (dataclasses.replace(record, access_count=0, f_r=0.0,
                                                         last_access=first.saved_variants[0].last_access),)


def test_stored_files_byte_identical_after_fused_requests(tiny_adapter, tmp_path):
    import hashlib

    from cachefuse.chunks import KeyContext
    from cachefuse.fusion.engine import FusionEngine
    from cachefuse.store.base import StoreIdentity
    from cachefuse.store.tiered import open_store

    adapter = tiny_adapter("llama31")
    identity = StoreIdentity("test-model", adapter.shape.num_layers, adapter.shape.dtype)
    store = open_store(tmp_path, identity, memory_capacity_bytes=1 << 30, disk_capacity_bytes=1 << 30)
    engine = FusionEngine(adapter, store, KeyContext("test-model", "float32"), CacheFuseConfig())
    case = make_case(adapter.shape.vocab_size, seed=9)
    precompute_case(engine, case)

    def digests() -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.rglob("*.safetensors")}

    before = digests()
    assert len(before) == 3
    for selector in ("cacheblend", "epic", "full_reuse"):
        engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.3)  # saves the hole once
    after = digests()
    assert len(after) == 4
    assert all(after[name] == digest for name, digest in before.items())


@pytest.mark.parametrize("schedule,mean_multiplier", [((1.0,), 1.0), ((2.0, 1.0), 1.5)])
def test_cacheblend_row_estimate_prices_the_rows_the_pass_computes(tiny_adapter, schedule, mean_multiplier):
    """The controller's row estimate (Selector.estimate_rows) against the candidate rows a real pass computes
    in its selective layers, with and without gradual filtering (check layers 1 and 2 of 4: layer 2 keeps
    2r, layer 3 r). Negative control: the ratio alone (the estimate before gradual filtering was priced)
    misses the gradual pass's rows."""
    from cachefuse.select.base import PlannedChunk, num_rows_for_ratio

    adapter = tiny_adapter("llama")
    num_layers = adapter.shape.num_layers
    checks = (1, 2)[:len(schedule)]
    config = CacheFuseConfig(cacheblend_check_layers=checks, cacheblend_ratio_schedule=schedule)
    engine = make_engine(adapter, config)
    case = make_case(adapter.shape.vocab_size, seed=6)
    precompute_case(engine, case)
    ratio = 0.2
    result, _ = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=ratio, save_holes=False)
    selector = make_selector("cacheblend", config)
    estimate = selector.estimate_rows([PlannedChunk(len(case.pieces[2]))], num_layers)  # A is at its exact place
    selective = range(selector.num_full_layers(num_layers), num_layers)
    computed = sum(result.rows_per_layer[layer].numel() - result.num_forced for layer in selective)
    estimated = num_rows_for_ratio(ratio, estimate.num_ratio_candidates) * len(selective)
    assert estimate.num_ratio_candidates == math.ceil(result.num_candidates * mean_multiplier)
    assert abs(computed - estimated) <= 2 * len(selective)  # ceil per layer against ceil of the mean
    if schedule != (1.0,):
        ratio_only = num_rows_for_ratio(ratio, result.num_candidates) * len(selective)
        assert computed - ratio_only > 2 * len(selective)


def ends_inside_and_shorter(adapter):
    """One engine whose store serves a RAG prompt with no question two ways: its last chunk declared to
    the prompt's end, or one token shorter before an undeclared last token, that shorter entry being the
    longer one's rows but the last (the same K/V, bit for bit: causal, same positions)."""
    from cachefuse.store.base import ChunkKV

    case = make_case(adapter.shape.vocab_size, seed=3, lengths=(12, 23, 19, 31, 0))  # no question
    start, end = case.chunks[-1]
    engine = make_engine(adapter)
    engine.precompute([case.system])
    engine.precompute([case.token_ids[s:e] for s, e in case.chunks[1:]], prefix_ids=case.system)
    entry = engine.store.get(engine.key(case.token_ids[start:end]))
    shorter = ChunkKV([k[:-1].clone() for k in entry.k_nope], [v[:-1].clone() for v in entry.v], dict(entry.meta))
    assert engine.store.put(engine.key(case.token_ids[start:end - 1]), shorter)
    return engine, case, [*case.chunks[:-1], (start, end - 1)]


@pytest.mark.parametrize("selector", ["epic", "fusionrag"])
def test_a_prompt_ending_inside_a_loaded_chunk_equals_that_chunk_declared_one_token_shorter(tiny_adapter, selector):
    """The last token is always computed, so a chunk that ends the prompt offers every row but its last as
    candidates, exactly as the same chunk declared one token shorter before an undeclared last token
    (whose entry holds the same K/V: causal, same positions). Selection, probe and result must not tell
    the two apart: EPIC once picked the forced last row as a candidate, and the question probe attended
    to position N-1 twice (its loaded K/V and its fresh ones; tests/fusion/test_probe.py compares its scores)."""
    engine, case, shorter_chunks = ends_inside_and_shorter(tiny_adapter("llama"))
    results = []
    for chunks in (case.chunks, shorter_chunks):
        result, stats = engine.prefill(case.token_ids, chunks, selector=selector, ratio=0.2, save_holes=False,
                                       preload_depth=0)
        assert stats.chunks_hit == len(chunks)
        results.append(result)
    ends_inside, shorter = results
    assert ends_inside.num_candidates == shorter.num_candidates
    assert ends_inside.num_selected == shorter.num_selected <= ends_inside.num_candidates
    assert [r.tolist() for r in ends_inside.rows_per_layer if r is not None] == \
        [r.tolist() for r in shorter.rows_per_layer if r is not None]
    assert torch.equal(ends_inside.logits, shorter.logits)


@pytest.mark.parametrize("selector", ["full_prefill", "cacheblend"])
def test_kept_k_and_v_own_their_memory(tiny_adapter, selector):
    """Every layer's K/V the pass keeps to its end (no KV-writing backend) is a tensor of its own: a view
    would hold the full layer's projection output alive ([T, q + 2 kv]: 6x V's bytes on Llama-3-8B)."""
    adapter = tiny_adapter("llama")
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=8)
    precompute_case(engine, case)
    result, _ = engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.2, save_holes=False)
    for tensor in (*result.k, *result.v):
        assert tensor.untyped_storage().nbytes() == tensor.nbytes

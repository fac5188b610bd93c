"""Cache-Craft statistics gathered in the blend pass equal those from an explicit attention matrix:
per hole, the attention mass its rows put on each segment, averaged over heads and layers."""


import pytest
import torch
from transformers import AutoModelForCausalLM

from cachefuse.adapters.hf import HFAdapter
from cachefuse.attention import segment_attention_mass
from cachefuse.config import CacheFuseConfig
from cachefuse.metadata.scores import Variant
from tests.helpers.fusion import make_case, make_engine, precompute_case


@pytest.mark.parametrize("block_rows", [1, 5, 64])
def test_segment_mass_matches_dense_softmax(block_rows):
    g = torch.Generator().manual_seed(0)
    num_tokens, heads, kv_heads, dim = 40, 4, 2, 8
    q = torch.randn(9, heads, dim, generator=g)
    positions = torch.tensor([3, 10, 11, 12, 20, 25, 30, 38, 39])
    k = torch.randn(num_tokens, kv_heads, dim, generator=g)
    segment_of_key = torch.tensor([0] * 5 + [1] * 15 + [2] * 20)
    mass = segment_attention_mass(q, positions, k, segment_of_key, 3, 0.3, block_rows)
    k_full = k.repeat_interleave(2, dim=1)
    scores = torch.einsum("rhd,khd->hrk", q, k_full) * 0.3
    scores = scores.masked_fill(torch.arange(num_tokens)[None, None, :] > positions[None, :, None], float("-inf"))
    probs = scores.softmax(-1)  # [heads, rows, keys], the explicit matrix
    expected = torch.stack([probs[:, :, segment_of_key == s].sum(dim=(1, 2)) for s in range(3)], dim=1)
    torch.testing.assert_close(mass, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass.sum(dim=1), torch.full((heads,), 9.0))  # each row's weights sum to 1


def test_hole_statistics_equal_transformers_attention_weights(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    adapter = HFAdapter.from_pretrained(path)
    engine = make_engine(adapter, CacheFuseConfig(collect_attention_stats=True))
    case = make_case(adapter.shape.vocab_size, seed=12)
    precompute_case(engine, case)  # B stays a hole
    result, _ = engine.prefill(case.token_ids, case.chunks, selector="full_prefill", save_holes=True)
    (hole,) = result.hole_segments
    eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        attentions = eager(torch.tensor([case.token_ids]), output_attentions=True).attentions  # L x [1, H, N, N]
    bounds = [0, *[end for _, end in case.chunks], len(case.token_ids)]
    b_start, b_end = case.chunks[hole]
    expected = torch.stack([
        torch.stack([layer[0, :, b_start:b_end, lo:hi].sum(dim=(1, 2)).mean() for lo, hi in zip(bounds, bounds[1:],
                                                                                                 strict=False)])
        for layer in attentions]).mean(dim=0)
    torch.testing.assert_close(torch.tensor(result.hole_attention[hole]), expected, atol=1e-4, rtol=1e-4)

    key_a = engine.key(case.pieces[0])
    (record,) = engine.metastore.variants(engine.key(case.pieces[1]))  # stored with the variant's metadata
    assert record.prefix == (key_a,) and record.has_stats
    stats = {"inter": record.inter, "intra": record.intra, "num_tokens": record.num_tokens,
             "prefix_num_tokens": record.prefix_num_tokens, "ranked_tokens": list(record.ranked_tokens)}
    assert list(stats["inter"]) == [key_a] and stats["num_tokens"] == len(case.pieces[1])
    assert abs(stats["inter"][key_a] - float(expected[1])) < 1e-4 and abs(stats["intra"] - float(expected[2])) < 1e-4
    variant = Variant(prefix=(key_a,), inter=stats["inter"], intra=stats["intra"], num_tokens=stats["num_tokens"],
                      prefix_num_tokens=stats["prefix_num_tokens"])
    assert 0.5 <= variant.cci < 1.0  # the stored statistics are what CCI needs

    # Recompute candidates: the hole's tokens ranked by the attention each pays to the prefix chunk A.
    a_start, a_end = case.chunks[1]
    per_token = torch.stack([layer[0, :, b_start:b_end, a_start:a_end].sum(dim=-1).mean(dim=0)
                             for layer in attentions]).mean(dim=0)  # [hole tokens]
    torch.testing.assert_close(
        torch.tensor([row[1] for row in result.hole_token_mass[hole]]), per_token, atol=1e-4, rtol=1e-4)
    ranked = stats["ranked_tokens"]
    assert sorted(ranked) == list(range(len(case.pieces[1])))
    values = per_token[ranked]
    assert bool((values[:-1] >= values[1:] - 1e-4).all())  # descending inter-attention


def test_stats_off_by_default(tiny_model_dir):
    adapter = HFAdapter.from_pretrained(str(tiny_model_dir("llama")))
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=12)
    precompute_case(engine, case)
    result, _ = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", save_holes=True)
    assert result.hole_attention == {}
    (record,) = engine.metastore.variants(engine.key(case.pieces[1]))
    assert not record.has_stats and record.ranked_tokens == () and record.cci == 0.5

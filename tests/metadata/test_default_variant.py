"""The default variant (cachefuse/metadata/index.py, rule 8; config `default_variant`): what a chunk loads where
no stored variant fits its prefix better than its base variant.

- "fused": a chunk after unrelated chunks loads its neighbour-fused variant (FusionRAG's fused cache, used
  wherever the chunk appears), at that variant's own CFO; "base" (the negative control) loads the base one;
- under both, Cache-Craft's choice stands for a variant stored for exactly this prefix, a variant whose
  prefix overlaps the new one enough to beat the base variant, the first chunk after the system prompt
  (its base variant is exact there) and the system chunk;
- a chunk with no variant computed after other chunks loads its base variant under "fused" too;
- the config refuses any other value, naming the field, the value and the choices.

The reference engine's and the vLLM scheduler's plans both go through `plan_variants` (the engine's plan is
tests/offline/test_neighbours.py's, the scheduler's tests/vllm/test_neighbour_precompute.py's).
"""

from __future__ import annotations

import pytest

from cachefuse.config import CacheFuseConfig
from cachefuse.errors import ConfigError
from cachefuse.metadata import scores
from cachefuse.metadata.base import VariantRecord
from cachefuse.metadata.index import Admission, VariantIndex, plan_variants

NEIGHBOURS = ("N1", "N2")


def neighbour_variant(chunk: str, prefix=NEIGHBOURS) -> VariantRecord:
    """`chunk` computed after `prefix`, with statistics (most of its attention within itself)."""
    return VariantRecord(chunk_key=chunk, prefix=prefix, inter=dict.fromkeys(prefix, 2.0), intra=6.0, num_tokens=4,
                         prefix_num_tokens=dict.fromkeys(prefix, 4), recompute_ratio=0.0)


def index_of(*records: VariantRecord) -> VariantIndex:
    keys = {"S", "U", "V", "C", *NEIGHBOURS}
    return VariantIndex([VariantRecord.without_stats(k, (), 4) for k in sorted(keys)] + list(records))


def loaded(index: VariantIndex, keys: list[str], default_variant: str, admission: Admission | None = None):
    """Per declared chunk (the first is the system chunk), the prefix of the variant it loads (None: computed)."""
    choices = plan_variants(index, keys, [True] + [False] * (len(keys) - 1), [4] * len(keys), 1.0, admission,
                            16, default_variant=default_variant)
    records = {r.variant_id: r for r in index.records()}
    return [None if c is None else records[c.variant_id].prefix for c in choices]


def test_after_unrelated_chunks_fused_loads_the_neighbour_variant_and_base_the_base_one():
    fused_c = neighbour_variant("C")
    index = index_of(fused_c)
    keys = ["S", "U", "V", "C"]  # C after U and V, which are not its neighbours
    assert loaded(index, keys, "fused")[3] == NEIGHBOURS
    assert loaded(index, keys, "base")[3] == ()  # negative control
    (choice,) = plan_variants(index, ["C"], [False], [4], 1.0, default_variant="fused")  # C first: exact base
    assert choice.store_key == "C" and choice.cfo == 0.0
    chosen = plan_variants(index, keys, [True, False, False, False], [4] * 4, 1.0, default_variant="fused")[3]
    assert chosen.store_key == fused_c.store_key and chosen.variant_id == fused_c.variant_id
    assert chosen.cfo == pytest.approx(scores.score_variant(fused_c.to_variant(), ("U", "V"), 1.0)[0])
    assert chosen.cfo == pytest.approx(fused_c.cci) and chosen.cfo > 0.5  # its own score, not the base's 0.5


def test_the_first_chunk_and_the_system_chunk_keep_their_exact_base_variants():
    index = index_of(neighbour_variant("C"), neighbour_variant("S", ("U",)))
    assert loaded(index, ["S", "C", "U"], "fused")[:2] == [(), ()]
    assert loaded(index, ["S", "U", "C"], "fused")[0] == ()  # the system chunk never moves


def test_a_variant_that_fits_the_prefix_better_wins_under_both_settings():
    exact = neighbour_variant("C", ("U",))
    index = index_of(neighbour_variant("C"), exact)
    for default_variant in ("base", "fused"):
        assert loaded(index, ["S", "U", "C"], default_variant)[2] == ("U",)  # stored for exactly this prefix
        assert loaded(index, ["S", "N1", "N2", "C"], default_variant)[3] == NEIGHBOURS  # the neighbours precede it
    # Several variants after other chunks, none matching: Cache-Craft's order among them (the lower CFO)
    low_cci = VariantRecord(chunk_key="C", prefix=("V",), inter={"V": 0.1}, intra=6.0, num_tokens=4,
                            prefix_num_tokens={"V": 4})
    index = index_of(neighbour_variant("C"), low_cci)
    assert low_cci.cci < neighbour_variant("C").cci
    assert loaded(index, ["S", "U", "C"], "fused")[2] == ("V",)


def test_a_chunk_without_a_fused_variant_loads_its_base_one():
    assert loaded(index_of(), ["S", "U", "C"], "fused")[2] == ()
    plain = VariantIndex(plain_keys=["S", "U", "C"])  # K/V without metadata rows: base variants (rule 3)
    assert plan_variants(plain, ["S", "U", "C"], [True, False, False], [4] * 3, 1.0,
                         default_variant="fused")[2].store_key == "C"


def test_admission_sees_the_fused_variants_score():
    """Under cachecraft's admission a chunk whose chosen variant scores CFO >= alpha / 2 is computed in full
    (rule 4): the neighbour variant after unrelated chunks scores above that, like the base variant."""
    index = index_of(neighbour_variant("C"))
    assert loaded(index, ["S", "U", "C"], "fused", Admission(0.5, 1))[2] is None
    assert loaded(index, ["S", "N1", "N2", "C"], "fused", Admission(0.5, 1))[3] == NEIGHBOURS  # CFO 0: loaded


def test_the_config_accepts_base_and_fused_only():
    assert CacheFuseConfig().default_variant == "base"
    assert CacheFuseConfig.from_dict({"default_variant": "fused"}).default_variant == "fused"
    with pytest.raises(ConfigError, match=r"default_variant='neighbours' is invalid: expected \"base\".*\"fused\""):
        CacheFuseConfig(default_variant="neighbours")

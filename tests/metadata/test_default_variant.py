"""The default variant (cachefuse/metadata/index.py, rule 8; config `default_variant`): what a chunk loads where
no stored variant fits its prefix better than its base variant.

- "fused" (the default): a chunk after unrelated chunks loads its neighbour-fused variant (stored by the
  offline neighbour step: FusionRAG's fused cache, used wherever the chunk appears), at that variant's own
  CFO; "base" (the negative control) loads the base one;
- a variant saved from a served request's hole (not marked neighbour-fused) never qualifies: beside a
  neighbour variant the neighbour one is loaded, alone the base variant (control: the same record marked is
  loaded, as the old rule loaded any variant computed after other chunks);
- in a store without neighbour variants "fused" plans exactly as "base";
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


def neighbour_variant(chunk: str, prefix=NEIGHBOURS, inter: float = 2.0, neighbour_fused: bool = True) -> VariantRecord:
    """`chunk` computed after `prefix`, with statistics (most of its attention within itself), marked as the
    offline neighbour step's unless `neighbour_fused` is False (then: a served request's hole)."""
    return VariantRecord(chunk_key=chunk, prefix=prefix, inter=dict.fromkeys(prefix, inter), intra=6.0,
                         num_tokens=4, prefix_num_tokens=dict.fromkeys(prefix, 4), recompute_ratio=0.0,
                         neighbour_fused=neighbour_fused)


def served_hole(chunk: str, prefix, inter: float = 2.0) -> VariantRecord:
    """`chunk` saved from a served request's hole after `prefix` (never marked neighbour-fused)."""
    return neighbour_variant(chunk, prefix, inter, neighbour_fused=False)


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
    # Several neighbour variants, none matching: Cache-Craft's order among them (the lower CFO)
    low_cci = neighbour_variant("C", ("V",), inter=0.1)
    index = index_of(neighbour_variant("C"), low_cci)
    assert low_cci.cci < neighbour_variant("C").cci
    assert loaded(index, ["S", "U", "C"], "fused")[2] == ("V",)


def test_a_served_hole_variant_never_stands_in_for_the_base_variant():
    """Beside the neighbour variant a served hole's variant (even one Cache-Craft's order ranks first among
    the fused ones: a lower CCI) is passed over; alone it leaves the base variant. Control: the same record
    marked neighbour-fused is loaded, as the old rule (any variant after other chunks) loaded it."""
    hole = served_hole("C", ("V",), inter=0.1)
    assert hole.cci < neighbour_variant("C").cci  # Cache-Craft's order prefers the hole among the two
    assert loaded(index_of(neighbour_variant("C"), hole), ["S", "U", "C"], "fused")[2] == NEIGHBOURS
    assert loaded(index_of(hole), ["S", "U", "C"], "fused")[2] == ()
    marked = neighbour_variant("C", ("V",), inter=0.1)
    assert marked.variant_id == hole.variant_id  # the same variant; only its origin differs
    assert loaded(index_of(neighbour_variant("C"), marked), ["S", "U", "C"], "fused")[2] == ("V",)
    assert loaded(index_of(marked), ["S", "U", "C"], "fused")[2] == ("V",)
    # rule 2 still weighs the hole's variant where it fits: stored for exactly this prefix, it wins under both
    for default_variant in ("base", "fused"):
        assert loaded(index_of(neighbour_variant("C"), hole), ["S", "V", "C"], default_variant)[2] == ("V",)


def test_without_neighbour_variants_fused_plans_exactly_as_base():
    """A store of base variants and served holes' variants: every prompt over its chunks, in every order,
    gets the same plan under both settings (choices compared whole: store key, variant, CFO, ranking)."""
    import itertools

    holes = [served_hole("C", ("U",)), served_hole("C", ("V", "U"), inter=0.5), served_hole("U", ("N1",), 0.2),
             served_hole("V", ("C", "N2"), inter=3.0), served_hole("N2", ("N1",))]
    index = index_of(*holes)
    plans = 0
    for size in (1, 2, 3, 4):
        for order in itertools.permutations(["U", "V", "C", "N1", "N2"], size):
            keys = ["S", *order]
            system = [True] + [False] * size
            for admission in (None, Admission(0.5, 1)):
                base = plan_variants(index, keys, system, [4] * len(keys), 1.0, admission, 16, default_variant="base")
                fused = plan_variants(index, keys, system, [4] * len(keys), 1.0, admission, 16,
                                      default_variant="fused")
                assert fused == base, keys
                plans += 1
    assert plans == 2 * (5 + 20 + 60 + 120)
    # negative control: one of these variants marked neighbour-fused changes some plan
    marked = index_of(*holes[:-1], neighbour_variant("N2", ("N1",)))
    assert loaded(marked, ["S", "U", "N2"], "fused")[2] == ("N1",)
    assert loaded(marked, ["S", "U", "N2"], "base")[2] == ()


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
    assert CacheFuseConfig().default_variant == "fused"  # the default since records carry their origin
    assert CacheFuseConfig.from_dict({"default_variant": "fused"}).default_variant == "fused"
    with pytest.raises(ConfigError, match=r"default_variant='neighbours' is invalid: expected \"base\".*\"fused\""):
        CacheFuseConfig(default_variant="neighbours")

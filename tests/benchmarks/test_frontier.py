"""benchmarks/frontier.py: the axes table and what is built from it (configurations, engine groups, the
defaults' point, the controller's quality, the Pareto frontier), and a --quick run end to end on the tiny
model (reference engine for quality, vLLM engines in subprocesses for TTFT)."""

from __future__ import annotations

import dataclasses
import json

import frontier
import frontier_ttft
import pytest
from frontier import Axis, Configuration

from cachefuse.config import CacheFuseConfig
from cachefuse.errors import ConfigError

DEFAULT = CacheFuseConfig().selector
WITH_DEFAULT = (DEFAULT, "cachecraft")
"""A grid holding the defaults' selector (CacheFuseConfig's), so the defaults' point is in it."""


def grid(selectors=("cacheblend", "cachecraft"), ratios=(0.15, 0.5), modes=("fixed", "controller"), side=None,
         fusion=("base", "fused"), exact=("on", "off")):
    all_axes = frontier.axes(selectors, ratios, modes, fusion, exact)
    return all_axes, frontier.configurations(all_axes, side)


def test_every_combination_of_axis_values_is_one_configuration():
    _, configs = grid(fusion=("base",), exact=("on",))
    assert len(configs) == 2 * 2 * 2
    assert len({c.name for c in configs}) == 8
    blend = next(c for c in configs if c.name == "cacheblend/0.5/controller/base/on")
    assert blend.overrides == {"selector": "cacheblend", "recompute_ratio": 0.5, "ratio_mode": "controller",
                               "default_variant": "base", "exact_places": True}


def test_side_axes_move_one_at_a_time_and_only_with_the_side_settings():
    """fusion=fused and exact=off each join the 8 default-valued configurations, never together; given side
    settings, only with those (both ratio modes). Negative control: not side axes, the full product."""
    _, every = grid()
    assert len(every) == 8 * 3
    assert not [c for c in every if c.label("fusion") == "fused" and c.label("exact") == "off"]
    _, some = grid(side={"cacheblend@0.15"})
    moved = sorted(c.name for c in some if (c.label("fusion"), c.label("exact")) != ("base", "on"))
    assert moved == ["cacheblend/0.15/controller/base/off", "cacheblend/0.15/controller/fused/on",
                     "cacheblend/0.15/fixed/base/off", "cacheblend/0.15/fixed/fused/on"]
    _, per_axis = grid(side={"cacheblend@0.15", "fusion:cacheblend@0.5"})  # fused also at 0.5, exact off not
    moved = sorted(c.name for c in per_axis if c.label("ratio_mode") == "fixed"
                   and (c.label("fusion"), c.label("exact")) != ("base", "on"))
    assert moved == ["cacheblend/0.15/fixed/base/off", "cacheblend/0.15/fixed/fused/on", "cacheblend/0.5/fixed/fused/on"]
    full = tuple(dataclasses.replace(a, side=False) for a in frontier.axes(("cacheblend",), (0.15,), ("fixed",)))
    assert len(frontier.configurations(full, {"epic@0.5"})) == 4


def test_a_bad_axis_value_fails_at_start_up_naming_the_field(capsys):
    with pytest.raises(ConfigError, match="recompute_ratio"):
        grid(ratios=(0.15, 1.5))
    for flag, value in (("--exact", "on,sometimes"), ("--exact", "off,on"), ("--fusion", "fused"),
                        ("--side-settings", "ratio:qcfuse@0.15")):
        with pytest.raises(SystemExit):  # the side axes' first value is the default's
            frontier.parse_args([flag, value])
        assert f"{flag}='{value}'" in capsys.readouterr().err
    assert frontier.parse_args(["--exact", "on,off", "--fusion", "base"]).exact == ("on", "off")  # control


def test_the_defaults_configuration_is_the_one_cachefuse_config_picks():
    _, configs = grid(WITH_DEFAULT)
    assert frontier.default_configuration(configs).name == f"{DEFAULT}/0.15/controller/fused/on"
    _, without = grid(WITH_DEFAULT, ratios=(0.05, 0.5))  # negative control: the default ratio is not in the grid
    with pytest.raises(SystemExit, match="recompute_ratio=0.15"):
        frontier.default_configuration(without)
    _, off_only = grid(WITH_DEFAULT, exact=("off",))  # nor is the default exact_places
    with pytest.raises(SystemExit, match="exact_places=True"):
        frontier.default_configuration(off_only)


def test_a_grid_without_the_controller_marks_the_defaults_fixed_twin():
    """A fixed-only grid (a quality run) marks the default selector's 0.15/fixed point, and says so; with the
    controller in the grid the mark is the controller's point. Negative control: a controller-only grid
    without the default ratio has no twin to fall back on."""
    _, fixed_only = grid(WITH_DEFAULT, modes=("fixed",))
    twin = frontier.default_configuration(fixed_only)
    assert twin.name == f"{DEFAULT}/0.15/fixed/fused/on" and "fixed twin" in frontier.default_mark(twin)
    _, both = grid(WITH_DEFAULT)
    assert frontier.default_mark(frontier.default_configuration(both)) == "the defaults' configuration"
    _, controller_only = grid(WITH_DEFAULT, ratios=(0.05,), modes=("controller",))
    with pytest.raises(SystemExit, match="recompute_ratio=0.15"):
        frontier.default_configuration(controller_only)


def test_full_reuse_is_timed_in_a_fixed_ratio_engine():
    """The default ratio_mode is the controller, which could turn full reuse down (timed as plain vLLM): the
    baseline goes with the defaults' fixed twin, or the first fixed configuration, or, with none, the first."""
    all_axes, configs = grid(WITH_DEFAULT)  # the defaults load fused entries: their timed twin is the base one
    assert frontier.full_reuse_host(configs, all_axes).name == f"{DEFAULT}/0.15/fixed/base/on"
    all_axes, other_ratios = grid(WITH_DEFAULT, ratios=(0.05, 0.5))
    assert frontier.full_reuse_host(other_ratios, all_axes).name == f"{DEFAULT}/0.05/fixed/base/on"
    all_axes, controlled = grid(WITH_DEFAULT, modes=("controller",))
    assert frontier.full_reuse_host(controlled, all_axes).name == f"{DEFAULT}/0.15/controller/base/on"


def test_one_engine_serves_every_per_request_value_and_cachecraft_gets_one_per_ratio():
    all_axes, configs = grid(fusion=("base",), exact=("on",))
    groups = frontier_ttft.speed_groups(configs, all_axes)
    by_key = {key: sorted(c.name for c in members) for key, members in groups.items()}
    assert by_key["default_variant=base,exact_places=True,ratio_mode=fixed"] == [
        "cacheblend/0.15/fixed/base/on", "cacheblend/0.5/fixed/base/on"]
    assert by_key["default_variant=base,exact_places=True,force_cfo=0.5,ratio_mode=controller"] == [
        "cachecraft/0.5/controller/base/on"]
    assert len(groups) == 2 + 4  # cacheblend: fixed, controller; cachecraft: 2 ratios x 2 modes


def test_fusion_is_timed_once_and_exact_places_off_in_an_engine_of_its_own():
    """A fused configuration takes its base twin's timing (same loads, same rows); exact=off changes which rows
    are candidates, so it is timed in its own engine. Each is measured for quality in its own group."""
    all_axes, configs = grid(selectors=("cacheblend",), ratios=(0.15,), modes=("fixed",))
    assert [c.name for c in configs] == ["cacheblend/0.15/fixed/base/on", "cacheblend/0.15/fixed/base/off",
                                         "cacheblend/0.15/fixed/fused/on"]
    timed = {key: [c.name for c in members] for key, members in frontier_ttft.speed_groups(configs, all_axes).items()}
    assert timed == {"default_variant=base,exact_places=True,ratio_mode=fixed": ["cacheblend/0.15/fixed/base/on"],
                     "default_variant=base,exact_places=False,ratio_mode=fixed": ["cacheblend/0.15/fixed/base/off"]}
    assert [frontier_ttft.speed_key(c, all_axes) for c in configs] == [
        "cacheblend/0.15/fixed/base/on", "cacheblend/0.15/fixed/base/off", "cacheblend/0.15/fixed/base/on"]
    assert sorted(frontier.quality_groups(all_axes, configs)) == ["base/off", "base/on", "fused/on"]
    fusion = next(a for a in all_axes if a.name == "fusion")
    assert not fusion.moves_speed and fusion.offline is not None


def test_a_quality_only_axis_is_timed_once_but_measured_per_value():
    """How a quality-only axis plugs in: an axis whose values change only what is loaded."""
    variant = Axis("variant", {"v": {}, "k": {"cacheblend_deviation": "k"}}, quality="reference", moves_speed=False)
    all_axes = (*frontier.axes(("cacheblend",), (0.15,), ("fixed",), ("base",), ("on",)), variant)
    configs = frontier.configurations(all_axes)
    assert len(configs) == 2
    timed = [c.name for members in frontier_ttft.speed_groups(configs, all_axes).values() for c in members]
    assert timed == ["cacheblend/0.15/fixed/base/on/v"]
    assert {frontier_ttft.speed_key(c, all_axes) for c in configs} == {"cacheblend/0.15/fixed/base/on/v"}
    assert sorted(frontier.quality_groups(all_axes, configs)) == ["base/on/k", "base/on/v"]
    # negative control: the same axis moving speed is timed per value
    moving = Axis("variant", variant.values, quality="reference", moves_speed=True)
    both = (*all_axes[:-1], moving)
    assert len(frontier_ttft.speed_groups(frontier.configurations(both), both)) == 2


def _decisions(fused: int, requests: int, ratios: list[float]) -> dict:
    return {"decisions": {"fused": fused, "requests": requests, "ratios": ratios}}


@pytest.mark.parametrize(("made", "expected"), [
    (_decisions(0, 6, []), "full_prefill"),          # no-go on every request: plain vLLM's quality
    (_decisions(6, 6, [0.15]), "cacheblend@0.15"),   # fused at the configured ratio
    (_decisions(3, 6, [0.15]), None),                # mixed: no quality claimed
    (_decisions(6, 6, [0.15, 0.4]), None),           # raised on some requests: no quality claimed
    (None, None),                                    # not timed
])
def test_the_controller_s_quality_is_what_it_did_with_the_timed_requests(made, expected):
    config = Configuration((("selector", "cacheblend"), ("ratio", "0.15"), ("ratio_mode", "controller")),
                           {"selector": "cacheblend", "recompute_ratio": 0.15, "ratio_mode": "controller"})
    assert frontier.decided_setting(config, made)[0] == expected
    fixed = Configuration(config.labels[:2] + (("ratio_mode", "fixed"),), {**config.overrides, "ratio_mode": "fixed"})
    assert frontier.decided_setting(fixed, made)[0] == "cacheblend@0.15"  # fixed: always its own setting


def test_the_frontier_keeps_exactly_the_points_no_other_beats_on_both_axes():
    def point(name, speedup, quality):
        return {"name": name, "speedup": speedup, "normalized_f1": quality, "baseline": True}

    points = [point("plain", 1.0, 1.0), point("fast", 4.0, 0.2), point("middle", 2.0, 0.8),
              point("dominated", 1.8, 0.7), point("tie_slower", 2.0, 0.75), point("unknown", 9.0, None)]
    frontier.mark_frontier(points)
    assert [p["name"] for p in points if p["on_frontier"]] == ["plain", "fast", "middle"]


def test_ratio_mode_twins_running_the_same_setting_do_not_dominate_each_other():
    """cacheblend@0.15 fixed at 2.60x and its controller twin, which fused every request at 15% (the same
    reference setting), at 2.58x: timing noise, so both are on the frontier. Negative controls: a controller
    twin whose requests ran plain (full prefill's quality) is compared as any point, and a point of another
    group (fused entries) with the same overrides still dominates."""
    def config(name, mode, speedup, quality, setting, group="base/on"):
        return {"name": name, "baseline": False, "speedup": speedup, "normalized_f1": quality, "group": group,
                "overrides": {"selector": "cacheblend", "recompute_ratio": 0.15, "ratio_mode": mode},
                "quality_setting": setting}

    points = [config("fixed", "fixed", 2.60, 0.5, "cacheblend@0.15"),
              config("controller", "controller", 2.58, 0.5, "cacheblend@0.15")]
    frontier.mark_frontier(points)
    assert [p["on_frontier"] for p in points] == [True, True]
    plain_run = [config("fixed", "fixed", 2.60, 0.5, "cacheblend@0.15"),
                 config("controller", "controller", 2.58, 0.5, "full_prefill")]
    frontier.mark_frontier(plain_run)
    assert [p["on_frontier"] for p in plain_run] == [True, False]
    other_group = [config("fused", "fixed", 2.60, 0.9, "cacheblend@0.15", group="fused/on"),
                   config("controller", "controller", 2.58, 0.5, "cacheblend@0.15")]
    frontier.mark_frontier(other_group)
    assert [p["on_frontier"] for p in other_group] == [True, False]


def _scores(values: list[float], kl: float = 0.1) -> dict:
    return {"scores": values, "kl": [kl] * len(values), "recompute_fraction": [0.15] * len(values)}


FULL, REUSE = [1.0, 0.8, 1.0, 0.6, 0.9, 0.7], [0.2, 0.0, 0.4, 0.2, 0.1, 0.3]
KINDS = ["single", "multi"] * 3


def test_query_aware_selectors_are_compared_with_cacheblend_item_by_item():
    """qcfuse at 0.75 of each item's gap and cacheblend at 0.25: +0.5 normalized in every resample, "above";
    fusionrag below cacheblend on every item: "below". Negative controls: epic (not query-aware) and
    qcfuse@0.3 (no cacheblend at 0.3) are not compared."""
    def at(fraction):
        return [r + fraction * (f - r) for f, r in zip(FULL, REUSE, strict=True)]

    group = {"full_prefill": _scores(FULL, 0.0), "full_reuse": _scores(REUSE), "cacheblend@0.15": _scores(at(0.25)),
             "qcfuse@0.15": _scores(at(0.75), kl=0.05), "fusionrag@0.15": _scores(at(0.1)),
             "epic@0.15": _scores(at(0.9)), "qcfuse@0.3": _scores(at(0.9))}
    out = frontier.paired_comparisons({"base/on": group}, (group["full_prefill"], group["full_reuse"]), KINDS, 0)
    by_selector = {(c["selector"], c["ratio"]): c for c in out}
    assert sorted(by_selector) == [("fusionrag", 0.15), ("qcfuse", 0.15)]
    qcfuse = by_selector[("qcfuse", 0.15)]
    assert qcfuse["verdict"] == "above" and qcfuse["at_or_above"] and qcfuse["against"] == "cacheblend"
    norm = qcfuse["by_kind"]["all"]["normalized_f1"]
    assert (norm["diff"], norm["ci_low"], norm["ci_high"]) == pytest.approx((0.5, 0.5, 0.5))
    assert set(qcfuse["by_kind"]) == {"all", "single", "multi"} and qcfuse["by_kind"]["single"]["f1"]["n"] == 3
    assert qcfuse["by_kind"]["all"]["kl"]["diff"] == pytest.approx(-0.05)
    fusionrag = by_selector[("fusionrag", 0.15)]
    assert fusionrag["verdict"] == "below" and not fusionrag["at_or_above"]
    target = frontier.query_aware_target(out, "base/on")
    assert target["met"] and target["significantly_above"] and target["best"]["selector"] == "qcfuse"
    assert not frontier.query_aware_target(out, "fused/on")["met"]  # read in the defaults' group only


def test_each_side_group_is_compared_with_the_defaults_group_setting_by_setting():
    """fused/on's cacheblend at the full prefill's F1 against base/on's at half the gap: +0.5 normalized, "above";
    base/off's identical to base/on's: no difference. Negative controls: baselines and a setting the default
    group lacks are not compared, nor is the default group with itself."""
    half = [0.5 * (f + r) for f, r in zip(FULL, REUSE, strict=True)]
    base = {"full_prefill": _scores(FULL, 0.0), "full_reuse": _scores(REUSE), "cacheblend@0.15": _scores(half)}
    groups = {"base/on": base, "base/off": dict(base),
              "fused/on": {**base, "full_reuse": _scores(half), "cacheblend@0.15": _scores(FULL),
                           "qcfuse@0.15": _scores(FULL)}}
    out = frontier.side_comparisons(groups, "base/on", (base["full_prefill"], base["full_reuse"]), KINDS, 0)
    by_group = {(c["group"], c["selector"]): c for c in out}
    assert sorted(by_group) == [("base/off", "cacheblend"), ("fused/on", "cacheblend")]
    fused = by_group[("fused/on", "cacheblend")]
    assert fused["verdict"] == "above" and fused["by_kind"]["all"]["normalized_f1"]["diff"] == pytest.approx(0.5)
    assert by_group[("base/off", "cacheblend")]["by_kind"]["all"]["f1"]["diff"] == 0.0


def test_every_group_is_normalized_against_the_full_grids_baselines_wherever_the_defaults_sit():
    """The fused group's full reuse is better than the base one's: it becomes its own baseline point, and the
    fused configuration's normalized F1 is measured against the base group's full reuse (FusionRAG's Eq. 11),
    so its gain shows, though the defaults (default_variant fused) sit in the fused group: normalized against
    their own group, full reuse [fused/on] would read 0, not 0.5. Negative control: the exact-off group's
    identical full reuse adds no point."""
    all_axes, configs = grid(selectors=("cacheblend",), ratios=(0.15,), modes=("fixed",))
    same = [0.5 * (f + r) for f, r in zip(FULL, REUSE, strict=True)]  # normalized 0.5
    base = {"full_prefill": _scores(FULL, 0.0), "full_reuse": _scores(REUSE), "cacheblend@0.15": _scores(same)}
    quality = {"base/on": base, "base/off": dict(base),
               "fused/on": {**base, "full_reuse": _scores(same), "cacheblend@0.15": _scores(FULL)}}
    default = frontier.default_configuration(configs)
    points = {p["name"]: p for p in frontier.build_points(all_axes, configs, quality, {}, KINDS, default, 0)}
    assert sorted(n for n, p in points.items() if p["baseline"]) == ["full_reuse", "full_reuse [fused/on]",
                                                                     "plain vLLM"]
    assert points["full_reuse [fused/on]"]["normalized_f1"] == pytest.approx(0.5)
    assert points["cacheblend/0.15/fixed/fused/on"]["normalized_f1"] == pytest.approx(1.0)
    assert points["cacheblend/0.15/fixed/base/on"]["normalized_f1"] == pytest.approx(0.5)
    assert points["cacheblend/0.15/fixed/fused/on"]["default"] and not points["cacheblend/0.15/fixed/base/on"]["default"]
    assert points["cacheblend/0.15/fixed/fused/on"]["speedup"] is None


def test_quick_run_on_the_tiny_model_writes_every_point_and_the_plot(tiny_model_dir, tmp_path):
    """Every axis end to end: the default group, exact places off (timed in its own engine) and neighbour
    fusion (its offline step on the reference engine's store; timed as its base twin), the paired comparisons."""
    out = tmp_path / "frontier.json"
    assert frontier.main(["--quick", "--model", str(tiny_model_dir("llama")), "--out", str(out),
                          "--items", "2", "--timed-items", "1", "--ratio-modes", "fixed"]) == 0
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000 and not out.with_suffix(".partial.json").exists()
    points = {p["name"]: p for p in result["points"]}
    configs = [p for p in points.values() if not p["baseline"]]
    assert sorted(p["name"] for p in configs) == [  # --quick: 2 selectors x 2 ratios; side axes at 15% only
        "cacheblend/0.15/fixed/base/off", "cacheblend/0.15/fixed/base/on", "cacheblend/0.15/fixed/fused/on",
        "cacheblend/0.5/fixed/base/on", "qcfuse/0.15/fixed/base/off", "qcfuse/0.15/fixed/base/on",
        "qcfuse/0.15/fixed/fused/on", "qcfuse/0.5/fixed/base/on"]
    assert [p["name"] for p in configs if p["default"]] == ["cacheblend/0.15/fixed/fused/on"]
    assert points["plain vLLM"]["speedup"] == 1.0 and points["plain vLLM"]["quality"]["kl_mean"] == 0.0
    assert points["full_reuse"]["speed"]["pairs"] == 1
    for p in configs:
        speed = p["speed"]
        assert speed["pairs"] == 1 and speed["speedup"] > 0
        assert len(speed["plain_s"]) == len(speed["fused_s"]) == 1
        assert speed["decisions"]["fused"] == 1 and speed["decisions"]["chunks_missed"] == 0
        assert speed["decisions"]["ratios"] == [float(p["axes"]["ratio"])]
        assert p["quality_setting"] == f"{p['axes']['selector']}@{p['axes']['ratio']}"
        assert set(p["quality"]["by_kind"]) == {"all", "single", "multi"}
        assert ("exact_places=False" in speed["engine"]) == (p["axes"]["exact"] == "off")
    for selector in ("cacheblend", "qcfuse"):  # fused: its base twin's timing, its own quality group
        fused, base = points[f"{selector}/0.15/fixed/fused/on"], points[f"{selector}/0.15/fixed/base/on"]
        assert fused["speed"] == base["speed"] and fused["group"] == "fused/on" and base["group"] == "base/on"
        # exact places off reached vLLM's scheduler: the first document's rows are candidates there too, so the
        # same ratio selects more rows than with it on (where that document is exact)
        off = points[f"{selector}/0.15/fixed/base/off"]
        assert off["speed"]["decisions"]["num_selected_median"] > base["speed"]["decisions"]["num_selected_median"]
    assert sorted(result["quality"]["groups"]) == ["base/off", "base/on", "fused/on"]
    assert result["quality"]["offline"]["fused/on"]["fusion"]["stored"] > 0
    assert sorted((c["group"], c["ratio"]) for c in result["paired"]) == [
        ("base/off", 0.15), ("base/on", 0.15), ("base/on", 0.5), ("fused/on", 0.15)]
    assert result["targets"]["query_aware_at_15"]["best"]["selector"] == "qcfuse"
    assert result["quality"]["kinds"] == {"single": 1, "multi": 1}
    assert result["layout"] == result["quality"]["layout"] == "short"
    assert result["speed"]["env"]["OMP_NUM_THREADS"] == str(len(result["speed"]["cpus"]))


def test_quality_only_and_speed_only_runs_join_into_one_frontier(tiny_model_dir, tmp_path):
    """--quality-only scores without vLLM (speed None, no plot); --speed-only times without scoring; --quality-from
    and --speed-from join them measuring nothing: a score edited in the quality file shows in the joined point
    (negative control for a silent re-measure), and every timing is the speed file's."""
    model = str(tiny_model_dir("llama"))
    common = ["--quick", "--model", model, "--items", "1", "--timed-items", "1", "--ratio-modes", "fixed"]
    quality_json, speed_json, joined_json = tmp_path / "q.json", tmp_path / "s.json", tmp_path / "j.json"
    assert frontier.main([*common, "--quality-only", "--out", str(quality_json)]) == 0
    quality = json.loads(quality_json.read_text())
    assert quality["speed"] is None and not quality_json.with_suffix(".png").exists()
    assert [p["name"] for p in quality["points"] if p["speedup"] is not None] == ["plain vLLM"]
    assert all(p["quality"] is not None for p in quality["points"])

    assert frontier.main([*common, "--speed-only", "--out", str(speed_json)]) == 0
    speed = json.loads(speed_json.read_text())
    assert sorted(speed["configurations"]) == ["cacheblend/0.15/fixed/base/off", "cacheblend/0.15/fixed/base/on",
                                               "cacheblend/0.5/fixed/base/on", "full_reuse",
                                               "qcfuse/0.15/fixed/base/off", "qcfuse/0.15/fixed/base/on",
                                               "qcfuse/0.5/fixed/base/on"]
    assert all(row["decisions"]["fused"] == 1 for row in speed["configurations"].values())
    assert "points" not in speed and not speed_json.with_suffix(".png").exists()

    quality["quality"]["groups"]["fused/on"]["cacheblend@0.15"]["scores"] = [0.123]
    quality_json.write_text(json.dumps(quality))
    assert frontier.main([*common, "--quality-from", str(quality_json), "--speed-from", str(speed_json),
                          "--out", str(joined_json)]) == 0
    joined = {p["name"]: p for p in json.loads(joined_json.read_text())["points"]}
    assert joined["cacheblend/0.15/fixed/fused/on"]["quality"]["by_kind"]["all"]["f1"]["mean"] == 0.123
    for name, row in speed["configurations"].items():
        assert joined[name]["speed"] == row
    assert joined["cacheblend/0.15/fixed/fused/on"]["speed"] == speed["configurations"]["cacheblend/0.15/fixed/base/on"]


def test_a_quality_run_split_into_shares_joins_without_measuring_again(tiny_model_dir, tmp_path):
    """--groups-only writes only its groups' per-item results (no points; --groups picks groups); --quality-from
    joins shares, and --settings keeps a grid that is not a full product. Negative control for a silent
    re-measure: a score edited in a share shows in the joined point."""
    common = ["--model", str(tiny_model_dir("llama")), "--items", "2", "--selectors", "cacheblend,qcfuse",
              "--ratios", "0.15", "--ratio-modes", "fixed", "--exact", "on"]
    share_a, share_b, joined_json = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "joined.json"
    assert frontier.main([*common, "--groups-only", "--fusion", "base", "--out", str(share_a)]) == 0
    assert frontier.main([*common, "--groups-only", "--groups", "fused/on", "--out", str(share_b)]) == 0
    a, b = (json.loads(p.read_text()) for p in (share_a, share_b))
    assert "points" not in a and sorted(a["quality"]["groups"]) == ["base/on"]
    assert sorted(b["quality"]["groups"]) == ["fused/on"] and b["quality"]["offline"]["fused/on"]["fusion"]["stored"]
    b["quality"]["groups"]["fused/on"]["cacheblend@0.15"]["scores"] = [0.25, 0.75]
    share_b.write_text(json.dumps(b))
    assert frontier.main([*common, "--quality-only", "--quality-from", str(share_a), str(share_b),
                          "--settings", "cacheblend@0.15", "--out", str(joined_json)]) == 0
    joined = json.loads(joined_json.read_text())
    assert [p["name"] for p in joined["points"] if not p["baseline"]] == ["cacheblend/0.15/fixed/base/on",
                                                                          "cacheblend/0.15/fixed/fused/on"]
    fused = next(p for p in joined["points"] if p["name"] == "cacheblend/0.15/fixed/fused/on")
    assert fused["quality"]["by_kind"]["all"]["f1"]["mean"] == 0.5
    assert joined["quality"]["groups"]["base/on"] == a["quality"]["groups"]["base/on"]


def test_a_group_measures_only_the_settings_an_earlier_run_lacks(tiny_model_dir, tmp_path):
    """--quality-from a share at 15%, then a grid at 15% and 50%: the earlier settings are kept as they are
    (an edited score shows: not measured again), only the 50% ones are measured, and the baselines measured
    again with them match the earlier ones. Negative control: an earlier full_reuse that differs item by item
    stops the run (settings measured by different code are not compared)."""
    common = ["--model", str(tiny_model_dir("llama")), "--items", "2", "--selectors", "cacheblend,qcfuse",
              "--ratio-modes", "fixed", "--exact", "on", "--fusion", "base"]
    share, joined_json = tmp_path / "share.json", tmp_path / "joined.json"
    assert frontier.main([*common, "--ratios", "0.15", "--groups-only", "--out", str(share)]) == 0
    earlier = json.loads(share.read_text())
    earlier["quality"]["groups"]["base/on"]["qcfuse@0.15"]["scores"] = [0.125, 0.875]
    share.write_text(json.dumps(earlier))
    assert frontier.main([*common, "--ratios", "0.15,0.5", "--groups-only", "--quality-from", str(share),
                          "--out", str(joined_json)]) == 0
    group = json.loads(joined_json.read_text())["quality"]["groups"]["base/on"]
    assert sorted(group) == ["cacheblend@0.15", "cacheblend@0.5", "full_prefill", "full_reuse", "qcfuse@0.15",
                             "qcfuse@0.5"]
    assert group["qcfuse@0.15"]["scores"] == [0.125, 0.875]
    assert group["full_reuse"] == earlier["quality"]["groups"]["base/on"]["full_reuse"]
    earlier["quality"]["groups"]["base/on"]["full_reuse"]["scores"] = [-1.0, -1.0]
    share.write_text(json.dumps(earlier))
    with pytest.raises(SystemExit, match="full_reuse differs"):
        frontier.main([*common, "--ratios", "0.15,0.5", "--groups-only", "--quality-from", str(share),
                       "--out", str(joined_json)])


def test_speed_shares_join_with_the_later_file_winning(tmp_path):
    """A grid timed in two runs: a --speed-only file and a full run's JSON join; a configuration both timed
    takes the later file's figures. Negative control: in the other order the other figure wins."""
    quiet, extra = tmp_path / "quiet.json", tmp_path / "extra.json"
    quiet.write_text(json.dumps({"configurations": {"full_reuse": {"speedup": 3.7}, "a": {"speedup": 2.5}}}))
    extra.write_text(json.dumps({"speed": {"configurations": {"full_reuse": {"speedup": 3.1}, "b": {"speedup": 1.2}}}}))
    joined = frontier_ttft.earlier_speed([extra, quiet], "short")
    assert {k: v["speedup"] for k, v in joined.items()} == {"full_reuse": 3.7, "a": 2.5, "b": 1.2}
    assert frontier_ttft.earlier_speed([quiet, extra], "short")["full_reuse"]["speedup"] == 3.1


def test_a_file_of_the_other_layout_is_refused(tmp_path):
    """Timings and scores join only over the same prompts: a file of the long layout (10-12 documents) never
    joins a short run, nor a file written before layouts (the short one) a long run. Negative control: the
    same files join a run of their own layout."""
    long_speed, old_speed = tmp_path / "long.json", tmp_path / "old.json"
    long_speed.write_text(json.dumps({"layout": "long", "configurations": {"full_reuse": {"speedup": 5.9}}}))
    old_speed.write_text(json.dumps({"configurations": {"full_reuse": {"speedup": 3.7}}}))
    with pytest.raises(SystemExit, match="layout long, this run has short"):
        frontier_ttft.earlier_speed([long_speed], "short")
    with pytest.raises(SystemExit, match="layout short, this run has long"):
        frontier_ttft.earlier_speed([old_speed], "long")
    assert frontier_ttft.earlier_speed([long_speed], "long")["full_reuse"]["speedup"] == 5.9
    long_quality = tmp_path / "q.json"
    long_quality.write_text(json.dumps({"quality": {"items": 2, "layout": "long", "groups": {"base/on": {}}}}))
    with pytest.raises(SystemExit, match="layout long, this run has short"):
        frontier.earlier_quality([long_quality], [None, None], "short")
    assert frontier.earlier_quality([long_quality], [None, None], "long")[0] == {"base/on": {}}

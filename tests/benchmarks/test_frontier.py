"""benchmarks/frontier.py: the axes table and what is built from it (configurations, engine groups, the
defaults' point, the controller's quality, the Pareto frontier), and a --quick run end to end on the tiny
model (reference engine for quality, vLLM engines in subprocesses for TTFT)."""

from __future__ import annotations

import json

import frontier
import pytest
from frontier import Axis, Configuration

from cachefuse.errors import ConfigError


def grid(selectors=("cacheblend", "cachecraft"), ratios=(0.15, 0.5), modes=("fixed", "controller")):
    all_axes = frontier.axes(selectors, ratios, modes)
    return all_axes, frontier.configurations(all_axes)


def test_every_combination_of_axis_values_is_one_configuration():
    _, configs = grid()
    assert len(configs) == 2 * 2 * 2
    assert len({c.name for c in configs}) == 8
    blend = next(c for c in configs if c.name == "cacheblend/0.5/controller")
    assert blend.overrides == {"selector": "cacheblend", "recompute_ratio": 0.5, "ratio_mode": "controller"}


def test_a_bad_axis_value_fails_at_start_up_naming_the_field():
    with pytest.raises(ConfigError, match="recompute_ratio"):
        grid(ratios=(0.15, 1.5))


def test_the_defaults_configuration_is_the_one_cachefuse_config_picks():
    _, configs = grid()
    assert frontier.default_configuration(configs).name == "cacheblend/0.15/controller"
    _, without = grid(ratios=(0.05, 0.5))  # negative control: the default ratio is not in the grid
    with pytest.raises(SystemExit, match="recompute_ratio=0.15"):
        frontier.default_configuration(without)


def test_full_reuse_is_timed_in_a_fixed_ratio_engine():
    """The default ratio_mode is the controller, which could turn full reuse down (timed as plain vLLM): the
    baseline goes with the defaults' fixed twin, or the first fixed configuration, or, with none, the first."""
    _, configs = grid()
    assert frontier.full_reuse_host(configs).name == "cacheblend/0.15/fixed"
    _, other_ratios = grid(ratios=(0.05, 0.5))
    assert frontier.full_reuse_host(other_ratios).name == "cacheblend/0.05/fixed"
    _, controlled = grid(modes=("controller",))
    assert frontier.full_reuse_host(controlled).name == "cacheblend/0.15/controller"


def test_one_engine_serves_every_per_request_value_and_cachecraft_gets_one_per_ratio():
    all_axes, configs = grid()
    groups = frontier.speed_groups(configs, all_axes)
    by_key = {key: sorted(c.name for c in members) for key, members in groups.items()}
    assert by_key["ratio_mode=fixed"] == ["cacheblend/0.15/fixed", "cacheblend/0.5/fixed"]
    assert by_key["force_cfo=0.5,ratio_mode=controller"] == ["cachecraft/0.5/controller"]
    assert len(groups) == 2 + 4  # cacheblend: fixed, controller; cachecraft: 2 ratios x 2 modes


def test_a_quality_only_axis_is_timed_once_but_measured_per_value():
    """How the neighbour-fusion hook plugs in: an axis whose values change only what is loaded."""
    variant = Axis("variant", {"v": {}, "k": {"cacheblend_deviation": "k"}}, quality="reference", moves_speed=False)
    all_axes = (*frontier.axes(("cacheblend",), (0.15,), ("fixed",)), variant)
    configs = frontier.configurations(all_axes)
    assert len(configs) == 2
    timed = [c.name for members in frontier.speed_groups(configs, all_axes).values() for c in members]
    assert timed == ["cacheblend/0.15/fixed/v"]
    assert {frontier.speed_key(c, all_axes) for c in configs} == {"cacheblend/0.15/fixed/v"}
    assert sorted(frontier.quality_groups(all_axes, configs)) == ["k", "v"]
    # negative control: the same axis moving speed is timed per value
    moving = Axis("variant", variant.values, quality="reference", moves_speed=True)
    both = (*all_axes[:-1], moving)
    assert len(frontier.speed_groups(frontier.configurations(both), both)) == 2


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
        return {"name": name, "speedup": speedup, "normalized_f1": quality}

    points = [point("plain", 1.0, 1.0), point("fast", 4.0, 0.2), point("middle", 2.0, 0.8),
              point("dominated", 1.8, 0.7), point("tie_slower", 2.0, 0.75), point("unknown", 9.0, None)]
    frontier.mark_frontier(points)
    assert [p["name"] for p in points if p["on_frontier"]] == ["plain", "fast", "middle"]


def test_quick_run_on_the_tiny_model_writes_every_point_and_the_plot(tiny_model_dir, tmp_path):
    out = tmp_path / "frontier.json"
    assert frontier.main(["--quick", "--model", str(tiny_model_dir("llama")), "--out", str(out),
                          "--items", "2", "--timed-items", "1"]) == 0
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    points = {p["name"]: p for p in result["points"]}
    configs = [p for p in points.values() if not p["baseline"]]
    assert len(configs) == 2 * 2 * 2  # --quick: 2 selectors x 2 ratios x 2 ratio modes
    assert [p["name"] for p in configs if p["default"]] == ["cacheblend/0.15/controller"]
    assert points["plain vLLM"]["speedup"] == 1.0 and points["plain vLLM"]["quality"]["kl_mean"] == 0.0
    assert points["full_reuse"]["speed"]["pairs"] == 1
    for p in configs:
        speed = p["speed"]
        assert speed["pairs"] == 1 and speed["speedup"] > 0
        assert len(speed["plain_s"]) == len(speed["fused_s"]) == 1
        if p["axes"]["ratio_mode"] == "fixed":  # every fixed request fused at its own ratio, every chunk loaded
            assert speed["decisions"]["fused"] == 1 and speed["decisions"]["chunks_missed"] == 0
            assert speed["decisions"]["ratios"] == [float(p["axes"]["ratio"])]
            assert p["quality_setting"] == f"{p['axes']['selector']}@{p['axes']['ratio']}"
        assert set(p["quality"]["by_kind"]) == {"all", "single", "multi"} if p["quality"] else True
    assert result["quality"]["kinds"] == {"single": 1, "multi": 1}
    assert result["speed"]["env"]["OMP_NUM_THREADS"] == str(len(result["speed"]["cpus"]))


def test_speed_only_times_every_configuration_and_scores_none(tiny_model_dir, tmp_path):
    out = tmp_path / "speed.json"
    assert frontier.main(["--quick", "--speed-only", "--model", str(tiny_model_dir("llama")), "--out", str(out),
                          "--items", "1", "--timed-items", "1", "--ratio-modes", "fixed"]) == 0
    result = json.loads(out.read_text())
    assert sorted(result["configurations"]) == ["cacheblend/0.15/fixed", "cacheblend/0.5/fixed", "full_reuse",
                                                "qcfuse/0.15/fixed", "qcfuse/0.5/fixed"]
    assert all(row["decisions"]["fused"] == 1 for row in result["configurations"].values())
    assert "points" not in result and not out.with_suffix(".png").exists()

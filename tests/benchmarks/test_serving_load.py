"""benchmarks/serving_load.py's command line and configurations: --quick, the connector config passed
through to the cachefuse server, which requests a point measures. No server."""

from __future__ import annotations

import json

import pytest
import serving_load
import vllm_server
from rag_load import Run, Sent


def kv_transfer_extra(configuration: serving_load.Configuration) -> dict:
    args = configuration.server_args
    return json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]


def configurations(argv: list[str], tmp_path) -> dict[str, serving_load.Configuration]:
    args = serving_load.parse_args(argv)
    args.max_model_len = 2048  # main() sets it from the workload
    return {c.name: c for c in serving_load.configurations(args, tmp_path / "store")}


def test_plain_and_cachefuse_keep_vllm_s_prefix_caching_and_differ_only_in_the_connector(tmp_path):
    chosen = configurations([], tmp_path)
    assert list(chosen) == ["plain", "plain_no_prefix_cache", "cachefuse"]
    for name in ("plain", "cachefuse"):  # vLLM's default (on) is left alone, as a deployment leaves it
        assert not any("prefix-caching" in arg for arg in chosen[name].server_args)
    assert chosen["plain_no_prefix_cache"].server_args[-1] == "--no-enable-prefix-caching"
    assert "--kv-transfer-config" not in chosen["plain"].server_args + chosen["plain_no_prefix_cache"].server_args
    assert chosen["cachefuse"].fused and not chosen["plain"].fused and not chosen["plain_no_prefix_cache"].fused
    common = chosen["plain"].server_args
    assert chosen["plain_no_prefix_cache"].server_args[:-1] == common
    assert chosen["cachefuse"].server_args[:len(common)] == common
    assert chosen["cachefuse"].server_args[len(common):][0] == "--kv-transfer-config"
    assert len(chosen["cachefuse"].server_args) == len(common) + 2


def test_cachefuse_config_is_merged_over_the_defaults_and_passed_through(tmp_path):
    extra = kv_transfer_extra(configurations(["--cachefuse-config", json.dumps(
        {"recompute_ratio": 0.3, "max_blend_tokens_per_step": 512, "a_field_of_tomorrow": [1, 2]})], tmp_path)["cachefuse"])
    assert extra["recompute_ratio"] == 0.3
    assert extra["max_blend_tokens_per_step"] == 512 and extra["a_field_of_tomorrow"] == [1, 2]
    assert extra["selector"] == "cacheblend" and extra["memory_capacity_bytes"] == 256 << 20
    assert extra["store_dir"] == str(tmp_path / "store")
    # the committed runs measured the fixed ratio, not the default controller; a given mode still wins
    assert extra["ratio_mode"] == "fixed"
    controlled = kv_transfer_extra(configurations(["--cachefuse-config", json.dumps({"ratio_mode": "controller"})],
                                                  tmp_path)["cachefuse"])
    assert controlled["ratio_mode"] == "controller"


def test_quick_sets_small_defaults_and_given_flags_still_win():
    args = serving_load.parse_args(["--quick", "--rates", "3,1"])
    assert (args.model_size, args.duration, args.clients, args.hit_rates) == ("tiny", 8.0, 4, [1.0])
    assert args.rates == [1.0, 3.0]
    full = serving_load.parse_args([])
    assert full.configs == ["plain", "plain_no_prefix_cache", "cachefuse"]
    assert (full.model_size, full.rates, full.hit_rates, full.clients) == ("bench", [1, 2, 4, 6, 8, 12], [0.5, 1.0], 16)
    assert full.out == vllm_server.REPO / "docs" / "benchmarks" / "serving_load"


@pytest.mark.parametrize("argv", [["--configs", "cachefuse"], ["--configs", "plain,cachefuze"],
                                  ["--configs", "plain,plain_prefix_cache"],
                                  ["--rates", "0,2"], ["--hit-rates", "1.5"], ["--cachefuse-config", "[1]"]])
def test_bad_command_lines_are_refused(argv):
    with pytest.raises(SystemExit):
        serving_load.parse_args(argv)


def test_a_point_measures_what_was_sent_after_the_warm_up():
    run = Run([Sent(0.5, "warm"), Sent(1.0, "first"), Sent(7.0, "last")], elapsed_s=9.0)
    outputs, window_s = serving_load.measured(run, warmup_s=1.0)
    assert outputs == ["first", "last"]
    assert window_s == 8.0

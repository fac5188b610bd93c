"""benchmarks/soak.py's server arguments and request mix: prefix caching on by default in both phases,
a max_model_len the tiny model's small KV cache holds, and both exactness checks in the mix. No server."""

from __future__ import annotations

from pathlib import Path

import pytest
import soak
import vllm_server

MiB = 1 << 20


@pytest.mark.parametrize("size", sorted(soak.MODELS))
def test_max_model_len_holds_the_longest_prompt_and_fits_the_kv_cache(size):
    _, doc_lengths, kv_cache_bytes = soak.MODELS[size]
    workload = soak.Workload(doc_lengths)
    length = soak.max_model_len(workload)
    assert length >= workload.max_prompt_tokens() + soak.MAX_TOKENS
    assert length & (length - 1) == 0
    # 2 (K and V) x layers x KV heads x head_dim x 4 bytes (float32) per token
    config = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 32, **vllm_server.MODELS[size][0]}
    bytes_per_token = 2 * config["num_layers"] * config["num_kv_heads"] * config["head_dim"] * 4
    assert length <= kv_cache_bytes // bytes_per_token * 15 // 16  # vLLM refused 2,048 of the tiny model's 2,048


def test_the_bench_model_keeps_the_committed_runs_max_model_len():
    _, doc_lengths, _ = soak.MODELS["bench"]
    assert soak.max_model_len(soak.Workload(doc_lengths)) == 2048


def test_the_longest_prompt_is_a_miss_with_the_longest_documents():
    workload = soak.Workload((60, 120))
    ids, _ = workload.prompt([0, 1, 2], [7] * 10, extra=[9] * 60)
    assert len(ids) <= workload.max_prompt_tokens() == 24 + 3 * 120 + 60 + 10


def test_prefix_caching_is_vllm_s_default_unless_turned_off():
    assert soak.build_parser().parse_args([]).prefix_caching == "on"
    on, off = soak.server_args(None, 512, prefix_caching=True), soak.server_args(None, 512, prefix_caching=False)
    assert not any("prefix-caching" in arg for arg in on)
    assert off == [*on, "--no-enable-prefix-caching"]
    assert on[on.index("--max-model-len") + 1] == "512"


def test_only_the_cachefuse_phase_loads_the_connector():
    fused = soak.server_args(Path("/tmp/store"), 2048, prefix_caching=True)
    assert "--kv-transfer-config" in fused and "--kv-transfer-config" not in soak.server_args(None, 2048, True)
    assert '"store_dir": "/tmp/store"' in fused[fused.index("--kv-transfer-config") + 1]
    assert '"ratio_mode": "fixed"' in fused[fused.index("--kv-transfer-config") + 1]  # as the committed runs
    assert soak.build_parser().parse_args([]).ratio_mode == "fixed"
    controlled = soak.server_args(Path("/tmp/store"), 2048, True, "controller")  # --ratio-mode controller
    assert '"ratio_mode": "controller"' in controlled[controlled.index("--kv-transfer-config") + 1]


def test_the_mix_checks_exactness_both_ways():
    assert set(soak.EXACT_KINDS) <= set(soak.KINDS)
    assert all(soak.KINDS[kind] > 0 for kind in soak.EXACT_KINDS)
    assert sum(soak.KINDS.values()) == pytest.approx(1.0)

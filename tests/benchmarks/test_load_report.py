"""benchmarks/load_report.py reads every committed serving_load result: those written before plain and
cachefuse kept vLLM's prefix caching on named the configurations plain, plain_prefix_cache and cachefuse
(prefix caching off but in plain_prefix_cache); the report must still draw and print them. No server."""

from __future__ import annotations

import json

import pytest
import vllm_server
from load_report import plot, print_summary

COMMITTED = sorted((vllm_server.REPO / "docs" / "benchmarks" / "serving_load").rglob("serving_load.json"))


def test_there_are_committed_results_to_read():
    assert len(COMMITTED) >= 2  # serving_load/ and serving_load/all_async/


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.parent.name))
def test_a_committed_result_is_drawn_and_printed(path, tmp_path, capsys):
    result = json.loads(path.read_text())
    print_summary(result)
    printed = capsys.readouterr().out
    for name in result["configurations"]:
        assert f"{name}: idle TTFT" in printed
    plot(result, tmp_path / "serving_load.png")
    assert (tmp_path / "serving_load.png").stat().st_size > 10_000

"""Tensor parallelism on CPU (TP=2, one core per rank): every rank scores only its own heads, the
scores are all-reduced, so both ranks recompute the same rows and the result equals TP=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cachefuse.metadata.sqlite import META_FILE
from cachefuse.store.disk import list_keys
from cachefuse.store_report import inspect_store

PROBE = Path(__file__).with_name("tp_probe.py")


def run_probe(model_dir: Path, store_dir: Path, tp_size: int, mode: str = "all") -> dict:
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1" if tp_size == 2 else "0-1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = subprocess.run([sys.executable, str(PROBE), str(model_dir), str(store_dir), str(tp_size), mode],
                         capture_output=True, text=True, timeout=400, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def max_diff(a: dict, b: dict) -> float:
    return max(abs(lp - b["logprobs"].get(token, float("-inf"))) for token, lp in a["logprobs"].items())


def test_tp2_selects_the_same_rows_as_tp1(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    tp1 = run_probe(model_dir, tmp_path / "tp1", 1)
    tp2 = run_probe(model_dir, tmp_path / "tp2", 2)
    assert tp2["ratio_15"]["stats"]["status"] == "fused" and tp2["ratio_15"]["stats"]["chunks_hit"] == 3
    assert tp2["ratio_15"]["stats"]["num_selected"] == tp1["ratio_15"]["stats"]["num_selected"]
    assert max_diff(tp1["ratio_1"], tp2["ratio_1"]) < 1e-4
    assert max_diff(tp1["ratio_15"], tp2["ratio_15"]) < 1e-4  # same rows on both ranks as on one
    assert max_diff(tp1["ratio_15"], tp1["ratio_1"]) > 1e-3  # and the ratio does change the result
    # per-rank entries: each rank stores its own heads under its own keys, in its own directory (its disk
    # tier's index, budget and pins are its own), the metadata at the top
    tp1_keys = list_keys(tmp_path / "tp1")
    rank_keys = [list_keys(tmp_path / "tp2" / f"tp2-rank{rank}") for rank in (0, 1)]
    assert len(rank_keys[0]) == len(rank_keys[1]) == len(tp1_keys) and not rank_keys[0] & rank_keys[1]
    assert not list_keys(tmp_path / "tp2") and (tmp_path / "tp2" / META_FILE).exists()
    assert set(tp2["index_keys"]) <= rank_keys[0] and rank_keys[0] <= set(tp2["index_keys"])  # not rank 1's
    summary = inspect_store(str(tmp_path / "tp2")).summary  # `cachefuse inspect` finds every row's entry (rank 0's)
    assert summary["variants"] > 0 and summary["stale"] == 0 and summary["orphans"] == 0


def test_a_fault_on_one_rank_only_makes_both_ranks_compute_the_chunk(tiny_model_dir, tmp_path):
    """Rank 1's entry of chunk a is corrupt, rank 0's is whole. The ranks agree before the pass: a is a
    hole on both (else each would recompute other rows and the model's all-reduces would deadlock), and
    the answer is TP=1's with a never stored."""
    model_dir = tiny_model_dir("llama")
    fault = run_probe(model_dir, tmp_path / "fault", 2, "fault_rank1")
    alone = run_probe(model_dir, tmp_path / "alone", 1, "skip_a")
    stats = fault["ratio_15"]["stats"]
    assert stats["status"] == "fused" and stats["chunks_hit"] == 2, stats
    assert set(stats["miss_reasons"]) <= {"other_rank_missed", "corrupt"} and stats["chunks_missed"] == 1
    assert alone["ratio_15"]["stats"]["chunks_hit"] == 2
    assert max_diff(alone["ratio_15"], fault["ratio_15"]) < 1e-4

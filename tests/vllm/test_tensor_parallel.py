"""Tensor parallelism on CPU (TP=2, one core per rank): every rank scores only its own heads, the
scores are all-reduced, so both ranks recompute the same rows and the result equals TP=1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cachefuse.metadata.sqlite import META_FILE
from cachefuse.store.disk import list_keys
from cachefuse.store_report import inspect_store

PROBE = Path(__file__).with_name("tp_probe.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


def run_probe(model_dir: Path, store_dir: Path, tp_size: int, mode: str = "all", timeout_s: float = 400,
              dump_dir: Path | None = None) -> dict:
    """The probe's results; subprocess.TimeoutExpired when it has not ended within `timeout_s` (a deadlock
    fails the test instead of hanging it). With `dump_dir`, the workers write their stacks there while a
    fault is armed (tp_probe.arm_fault)."""
    # The probe runs as a script: without REPO_ROOT first on its path, `import cachefuse` finds whichever
    # checkout the environment's editable install points at, not the code under test.
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1" if tp_size == 2 else "0-1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    args = [str(model_dir), str(store_dir), str(tp_size), mode, *([str(dump_dir)] if dump_dir else [])]
    probe = subprocess.Popen([sys.executable, str(PROBE), *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)  # its own process group: its workers go with it
    try:
        stdout, stderr = probe.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(probe.pid, signal.SIGKILL)
        probe.communicate()
        raise
    out = subprocess.CompletedProcess(probe.args, probe.returncode, stdout, stderr)
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


@pytest.mark.parametrize("mode", ["midpass_loader", "midpass_select", "midpass_probe", "midpass_start"])
def test_a_rank_that_raises_mid_pass_makes_every_rank_fall_back(tiny_model_dir, tmp_path, mode):
    """Rank 1 alone raises in the blend pass: in layer 2's merge of its loaded K/V; in its check layer's
    selection before the score sum; in layer 1 of a fusionrag pass's question probe, after the probe's
    layer-0 all-reduces; at its start (hashing its keys), before it pins or reads anything and
    before the ranks agree on hits. Every collective of a pass is
    an op of the batch, preceded by the ranks' agreement on failures, so both fall back together: the
    request runs as plain vLLM (the answer of ratio 1.0, every row recomputed), and the engine keeps
    serving (the same prompt again is fused). The negative control is
    test_without_the_agreement_a_mid_pass_fault_deadlocks."""
    model_dir = tiny_model_dir("llama")
    result = run_probe(model_dir, tmp_path / "store", 2, mode, timeout_s=300)
    stats = result["ratio_15"]["stats"]
    assert stats["status"] == "fallback" and stats["fallback_reason"] == "blend_error", stats
    assert max_diff(result["ratio_1"], result["ratio_15"]) < 1e-4  # plain vLLM's answer
    again = result["again"]["stats"]
    assert again["status"] == "fused" and again["chunks_hit"] == 3, again


def test_without_the_agreement_a_mid_pass_fault_deadlocks(tiny_model_dir, tmp_path):
    """Negative control: the same fault on rank 1 with the ranks' agreement during the pass switched off.
    Rank 1 falls back and runs the step's forward, whose all-reduces pair with rank 0's remaining blend
    layers; rank 0 is then left in vLLM's forward, in an all-reduce rank 1 never enters, while rank 1
    waits for the next step: the probe never finishes, and the stacks say where each rank stands."""
    model_dir = tiny_model_dir("llama")
    dumps = tmp_path / "stacks"
    dumps.mkdir()
    with pytest.raises(subprocess.TimeoutExpired):
        run_probe(model_dir, tmp_path / "store", 2, "midpass_unagreed", timeout_s=150, dump_dir=dumps)
    rank0, rank1 = (_main_thread_stack((dumps / f"rank{rank}.txt").read_text()) for rank in (0, 1))
    assert "all_reduce" in rank0 and "_model_forward" in rank0, rank0  # in vLLM's own forward
    assert "all_reduce" not in rank1 and "worker_busy_loop" in rank1, rank1


def _main_thread_stack(dumps: str) -> str:
    """The main thread's stack in a rank's last faulthandler dump."""
    last = dumps.rsplit("Timeout (", 1)[-1]
    return next(block for block in last.split("\n\n") if "worker_main" in block)

"""Async scheduling (vLLM's default on GPUs): a blend that fails must not need vLLM's KV-load-failure
recovery after vLLM has scheduled the request's next step, which vLLM 0.32 cannot do (the engine dies).
cachefuse makes every blend an asynchronous load there, whose failure vLLM learns before it schedules the
request. The fault tests (test_failures.py) run under both schedulers; this is their negative control:
the same failure with synchronous blends under async scheduling kills the engine. Each run is its own
process (async_probe.py), so the engine that dies takes nothing else with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).with_name("async_probe.py")


def run_probe(model_dir: Path, store_dir: Path, mode: str) -> tuple[int, dict | None, str]:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = subprocess.run([sys.executable, str(PROBE), str(model_dir), str(store_dir), mode],
                         capture_output=True, text=True, timeout=400, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(lines[-1].removeprefix("RESULT ")) if lines else None
    return out.returncode, result, out.stdout[-2000:] + out.stderr[-3000:]


def test_a_failed_blend_under_async_scheduling_runs_plain_and_the_engine_serves_on(tiny_model_dir, tmp_path):
    code, result, log = run_probe(tiny_model_dir("llama"), tmp_path / "async", "async_loads")
    assert code == 0 and result is not None, log
    assert result["failed"]["status"] == "fallback" and result["failed"]["fallback_reason"] == "blend_error"
    assert len(result["failed_tokens"]) == 4  # vLLM recomputed it and decoded on
    assert result["fused"]["status"] == "fused"


def test_negative_control_synchronous_blends_under_async_scheduling_kill_the_engine(tiny_model_dir, tmp_path):
    code, result, log = run_probe(tiny_model_dir("llama"), tmp_path / "sync", "sync_loads")
    assert code != 0 and result is None, log
    assert "IndexError" in log

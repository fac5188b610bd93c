"""`cachefuse profile` prints the figures the worker measured (here on a tiny model)."""

import json
import os
import subprocess
import sys


def test_profile_prints_measured_figures(tiny_model_dir, tmp_path):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    out = subprocess.run(
        [sys.executable, "-m", "cachefuse.cli", "profile", "--model", str(tiny_model_dir("llama")),
         "--store", str(tmp_path), "--prompt-tokens", "400", "--requests", "2", "--max-model-len", "2048",
         "--kv-cache-memory-bytes", str(64 << 20), "--json"],
        capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    figures = json.loads("\n".join(lines[len(lines) - 1 - lines[::-1].index("{"):]))  # the JSON ends stdout
    assert figures["samples"]["prefill_steps"] >= 2 and figures["samples"]["blend_layers"] >= 8
    assert figures["compute"]["per_row_s"] + figures["compute"]["fixed_s"] > 0
    assert figures["compute"]["prefill_per_token_s"] + figures["compute"]["prefill_fixed_s"] > 0

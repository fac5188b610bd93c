"""The examples run as a user runs them: subprocesses on a tiny local model.

- examples/offline_batch.py: every request of the second pass (same chunks, new orders) hits all
  of its chunks;
- examples/client.py against the server of test_server.py (the same session-scoped server):
  both endpoints answer with the request's cachefuse figures.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.vllm.test_server import SERVED_MODEL_NAME, cachefuse_server  # noqa: F401  (shared fixture)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REQUEST_LINE = re.compile(r"request (\d+): chunks \[[\d, ]+\], (\d+) tokens: hits (\d+)/(\d+) .*status (\w+)")


def run_example(args: list[str], cwd: Path) -> str:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_offline_batch_hits_on_the_second_pass(tiny_model_dir, tmp_path):
    stdout = run_example([str(EXAMPLES / "offline_batch.py"), "--model-dir", str(tiny_model_dir("llama")),
                          "--store", str(tmp_path / "store"), "--pool-size", "4", "--chunks-per-prompt", "3",
                          "--num-prompts", "3", "--sentences-per-chunk", "3", "--max-tokens", "2",
                          "--kv-cache-memory-bytes", str(64 << 20)], cwd=tmp_path)
    first, second = stdout.split("pass 1 (", 1)[1].split("pass 2 (", 1)
    first_hits = [REQUEST_LINE.search(line).groups() for line in first.splitlines() if "request " in line]
    second_hits = [REQUEST_LINE.search(line).groups() for line in second.splitlines() if "request " in line]
    assert len(first_hits) == len(second_hits) == 3, stdout
    assert first_hits[0][2] == "0", stdout  # a cold store: the first request hits nothing
    for _, _, hits, chunks, status in second_hits:
        assert (hits, chunks, status) == ("4", "4", "fused"), stdout  # system prompt + 3 chunks
    assert re.search(r"pass 1: [\d.]+ s, pass 2: [\d.]+ s for 3 requests", stdout), stdout


def test_client_against_the_server(cachefuse_server, tmp_path):  # noqa: F811
    stdout = run_example([str(EXAMPLES / "client.py"), "--base-url", cachefuse_server.base_url,
                          "--model-dir", str(cachefuse_server.model_dir), "--served-model-name", SERVED_MODEL_NAME,
                          "--max-tokens", "4", "--json"], cwd=tmp_path)
    completions, chat = (json.loads(line) for line in stdout.strip().splitlines())
    assert (completions["endpoint"], chat["endpoint"]) == ("completions", "chat")
    for result in (completions, chat):
        assert isinstance(result["answer"], str)
        assert result["cachefuse"]["status"] == "fused", result
    # The completion stored every chunk (or found it stored): the chat request hits them all.
    assert chat["cachefuse"]["chunks_hit"] == chat["cachefuse"]["chunks"] == 4, chat

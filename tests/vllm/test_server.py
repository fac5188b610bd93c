"""examples/serve.sh: vLLM's OpenAI server with CacheFuseConnector on CPU, one server for every test.

- /v1/completions (token ids) and /v1/chat/completions (ids in kv_transfer_params["prompt_token_ids"])
  answer 200 and carry the request's cachefuse figures in `kv_transfer_params`;
- 8 concurrent requests with the same chunks in shuffled orders all succeed, each with its figures;
- malformed cachefuse parameters still get the plain completion, with the fallback reason.

The server listens on an ephemeral port of 127.0.0.1 and is stopped by its PID (SIGTERM, then
SIGKILL of its process group). `cachefuse_server` is session-scoped and shared through a module
global, so test_examples.py, which imports it, talks to the same server.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cachefuse.rag_prompt import build_rag_prompt

REPO = Path(__file__).resolve().parents[2]
SERVE_SH = REPO / "examples" / "serve.sh"
SERVED_MODEL_NAME = "tiny"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0

SYSTEM = "You answer from the documents below.\n"
CHUNKS = [f"Document {i}: the {thing} of Surap is {i + 5} miles from the canal of Velmar.\n"
          for i, thing in enumerate(["river", "bridge", "tower", "market", "garden"])]


@dataclass
class Server:
    base_url: str
    model_dir: Path
    process: subprocess.Popen
    log_path: Path


_shared: dict[str, Any] = {"server": None, "users": 0}  # one server per session, whichever module asks first


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post_json(base_url: str, path: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, Any]:
    """POSTs JSON; returns (status, parsed body) for 2xx and HTTP errors alike."""
    request = urllib.request.Request(f"{base_url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def _log_tail(server_log: Path, num_chars: int = 4000) -> str:
    return server_log.read_text(errors="replace")[-num_chars:] if server_log.exists() else ""


def start_server(model_dir: Path, store: Path, log_path: Path) -> Server:
    port = free_port()
    env = dict(os.environ, MODEL=str(model_dir), HOST="127.0.0.1", PORT=str(port), STORE=str(store),
               SERVED_MODEL_NAME=SERVED_MODEL_NAME, MAX_MODEL_LEN="2048", DEVICE="cpu", PYTHON=sys.executable,
               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(["bash", str(SERVE_SH)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", model_dir, process, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"serve.sh exited with {process.returncode}:\n{_log_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{server.base_url}/health", timeout=2) as response:
                if response.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(1.0)
    stop_server(server)
    raise RuntimeError(f"the server was not healthy after {START_TIMEOUT_S:.0f} s:\n{_log_tail(log_path)}")


def stop_server(server: Server) -> None:
    """SIGTERM to the server's PID (it stops its engine processes), SIGKILL of its group if it hangs."""
    process = server.process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: the group id is its PID
            process.wait(timeout=STOP_TIMEOUT_S)


@pytest.fixture(scope="session")
def cachefuse_server(tiny_model_dir, tmp_path_factory):
    if _shared["server"] is None:
        root = tmp_path_factory.mktemp("server")
        _shared["server"] = start_server(tiny_model_dir("llama"), root / "store", root / "server.log")
    _shared["users"] += 1
    yield _shared["server"]
    _shared["users"] -= 1
    if _shared["users"] == 0:
        server, _shared["server"] = _shared["server"], None
        stop_server(server)


@pytest.fixture(scope="module")
def tokenizer(cachefuse_server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(cachefuse_server.model_dir))


def completion_body(prompt_ids: list[int], kv_transfer_params: Any = None, max_tokens: int = 4) -> dict:
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body


def test_completions_carry_cachefuse_stats(cachefuse_server, tokenizer):
    prompt = build_rag_prompt(tokenizer, SYSTEM, CHUNKS[:3], "Question: how far is the tower?")
    for _ in range(2):  # the first stores the chunks (or finds them), the second hits them all
        status, body = post_json(cachefuse_server.base_url, "/v1/completions",
                                 completion_body(prompt.token_ids, prompt.kv_transfer_params()))
        assert status == 200, body
        stats = body["kv_transfer_params"]["cachefuse"]
        assert stats["status"] == "fused" and stats["fallback_reason"] is None, stats
        assert stats["chunks"] == 4 and stats["chunks_hit"] + stats["chunks_missed"] == 4, stats
    assert (stats["chunks_hit"], stats["tokens_reused"] > 0) == (4, True), stats
    assert body["usage"]["prompt_tokens"] == prompt.num_tokens


def test_chat_completions_use_the_forwarded_token_ids(cachefuse_server, tokenizer):
    question = "Question: where is the market?"
    prompt = build_rag_prompt(tokenizer, SYSTEM, [CHUNKS[3], CHUNKS[1]], question)
    body = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": question}], "max_tokens": 4,
            "temperature": 0.0, "kv_transfer_params": {"prompt_token_ids": prompt.token_ids,
                                                       **prompt.kv_transfer_params()}}
    status, response = post_json(cachefuse_server.base_url, "/v1/chat/completions", body)
    assert status == 200, response
    assert isinstance(response["choices"][0]["message"]["content"], str)
    stats = response["kv_transfer_params"]["cachefuse"]
    assert stats["status"] == "fused" and stats["chunks"] == 3, stats
    # The ids were used as they are, not the chat template's rendering of `messages`.
    assert response["usage"]["prompt_tokens"] == prompt.num_tokens


def test_concurrent_requests_in_shuffled_orders(cachefuse_server, tokenizer):
    prompts = []
    for i in range(8):
        order = random.Random(i).sample(CHUNKS, 3)
        prompts.append(build_rag_prompt(tokenizer, SYSTEM, order, f"Question {i}: how far?"))

    def send(prompt):
        return post_json(cachefuse_server.base_url, "/v1/completions",
                         completion_body(prompt.token_ids, prompt.kv_transfer_params()))

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(send, prompts))
    for (status, body), prompt in zip(results, prompts, strict=True):
        assert status == 200, body
        stats = body["kv_transfer_params"]["cachefuse"]
        assert stats["status"] == "fused" and stats["fallback_reason"] is None, stats
        assert stats["chunks"] == 4 and stats["chunks_hit"] + stats["chunks_missed"] == 4, stats
        assert body["usage"]["prompt_tokens"] == prompt.num_tokens


def test_malformed_params_get_a_plain_completion(cachefuse_server, tokenizer):
    prompt = build_rag_prompt(tokenizer, SYSTEM, CHUNKS[:2], "Question: which river?")
    status, plain = post_json(cachefuse_server.base_url, "/v1/completions", completion_body(prompt.token_ids))
    assert status == 200, plain
    assert plain.get("kv_transfer_params") is None  # no opt-in, nothing to report
    status, body = post_json(cachefuse_server.base_url, "/v1/completions",
                             completion_body(prompt.token_ids, {"cachefuse": {"chunks": [[5, 3]]}}))
    assert status == 200, body
    stats = body["kv_transfer_params"]["cachefuse"]
    assert (stats["status"], stats["fallback_reason"], stats["field"]) == (
        "fallback", "malformed_request", "cachefuse.chunks[0]"), stats
    assert body["choices"][0]["text"] == plain["choices"][0]["text"]


def test_prometheus_exposes_cachefuse_counters(cachefuse_server, tokenizer):
    """The connector's stats reach /metrics (vLLM observes them at each logging interval)."""
    prompt = build_rag_prompt(tokenizer, "Metrics system prompt.\n", ["Metrics chunk one.\n"], "Q?")
    status, _ = post_json(cachefuse_server.base_url, "/v1/completions",
                          completion_body(prompt.token_ids, prompt.kv_transfer_params()))
    assert status == 200
    deadline = time.monotonic() + 60  # bounded: stats are pushed at vLLM's logging interval
    text = ""
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{cachefuse_server.base_url}/metrics", timeout=5) as response:
            text = response.read().decode()
        fused = [line for line in text.splitlines() if line.startswith("vllm:cachefuse_requests_fused_total")]
        if fused and float(fused[0].rsplit(" ", 1)[1]) > 0:
            return
        time.sleep(1.0)
    raise AssertionError("no vllm:cachefuse_requests_fused_total > 0 in /metrics:\n" + text[-2000:])


def test_the_server_keeps_vllms_defaults(cachefuse_server, tokenizer):
    """serve.sh adds the --kv-transfer-config and nothing else: vLLM's prefix cache stays on (vLLM logs its
    engine config at start-up), and fused requests are served beside it."""
    log = cachefuse_server.log_path.read_text(errors="replace")
    assert "enable_prefix_caching=True" in log and "enable_prefix_caching=False" not in log
    prompt = build_rag_prompt(tokenizer, SYSTEM, CHUNKS[2:4], "Question: how far is the garden?")
    for _ in range(2):
        status, body = post_json(cachefuse_server.base_url, "/v1/completions",
                                 completion_body(prompt.token_ids, prompt.kv_transfer_params()))
        assert status == 200 and body["kv_transfer_params"]["cachefuse"]["status"] == "fused", body

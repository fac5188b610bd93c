"""vLLM's OpenAI server as the serving benchmarks run it: the bench models, start and stop, plain HTTP
calls and /metrics, the machine as a result records it; shared by benchmarks/soak.py,
benchmarks/serving_load.py and benchmarks/mixed_load.py.

A server listens on 127.0.0.1 only, runs in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with its
OpenMP threads pinned to CPUs 0-1 (VLLM_CPU_OMP_THREADS_BIND), so every configuration a benchmark
compares gets the same two cores, and under the malloc named by `--allocator` (LD_PRELOAD). It is
started as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script is not used).

Not a script: imported by the benchmarks above (which put this folder on sys.path).
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers.redis_server import free_port  # noqa: E402

MODELS = {  # size -> (model config for cached_tiny_model, document lengths in tokens)
    "tiny": ({}, (60, 120)),  # the test model: 4 layers x 128
    "bench": (dict(num_layers=12, hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=4,
                   head_dim=64, vocab_size=1024, max_position_embeddings=8192),
              (200, 300)),  # benchmarks/vllm_ttft.py's model
}
SERVED_MODEL_NAME = "tiny"
ALLOCATORS = {"glibc": None, "tcmalloc": "libtcmalloc_minimal.so.4", "jemalloc": "libjemalloc.so.2"}
CPU_BIND = "0-1"
START_TIMEOUT_S = 180
IDLE_WAIT_S = 60


def machine() -> dict:
    """What a serving benchmark's result records of the machine: CPU, the servers' threads, versions."""
    import torch
    import vllm

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"machine": platform.machine(), "cpu": cpu, "cpus_online": os.cpu_count(),
            "server_threads_bound": CPU_BIND, "python": platform.python_version(),
            "vllm": vllm.__version__, "torch": torch.__version__, "platform": platform.platform()}


def model_cache() -> Path:
    """Where tiny checkpoints are cached: $CACHEFUSE_TEST_MODEL_CACHE (as the tests read it) or .cache/test-models."""
    return Path(os.environ.get("CACHEFUSE_TEST_MODEL_CACHE") or REPO / ".cache" / "test-models")


def bench_model(model_size: str) -> Path:
    """The checkpoint of MODELS[model_size], built once and cached (cachefuse.testing.tiny_models)."""
    from cachefuse.testing.tiny_models import cached_tiny_model

    return cached_tiny_model("llama", model_cache(), **MODELS[model_size][0])


def allocator_library(name: str) -> str | None:
    """The shared library to LD_PRELOAD for `name`, or None for glibc's malloc; a missing library fails here."""
    library = ALLOCATORS[name]
    if library is None:
        return None
    found = [str(p) for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")
             if (p := Path(d) / library).exists()]
    if not found:
        raise SystemExit(f"--allocator {name}: {library} not found; install it (Debian: "
                         f"libtcmalloc-minimal4 or libjemalloc2) or pass --allocator glibc")
    return found[0]


def kv_transfer_config(extra_config: dict) -> str:
    """The `--kv-transfer-config` JSON that loads CacheFuseConnector with `extra_config` as its config."""
    return json.dumps({
        "kv_connector": "CacheFuseConnector", "kv_connector_module_path": "cachefuse.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra_config})


def server_env(allocator: str | None) -> dict[str, str]:
    """The server's environment: pinned threads, offline, and the allocator preloaded."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # it would override the size
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=CPU_BIND, HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1")
    if allocator:  # vLLM's CPU guide preloads tcmalloc; under glibc's malloc even plain vLLM's RSS grows ~29%
        env["LD_PRELOAD"] = ":".join(filter(None, [allocator, env.get("LD_PRELOAD")]))
    return env


def start_server(model_dir: Path, log: Path, kv_cache_bytes: int, server_args: list[str],
                 allocator: str | None = None) -> tuple[subprocess.Popen, int]:
    """Starts a server on a free loopback port and waits until /health answers.

    Args:
        model_dir: the checkpoint, served as SERVED_MODEL_NAME in float32, eager mode.
        log: where the server's stdout and stderr go.
        kv_cache_bytes: vLLM's KV cache size (`--kv-cache-memory-bytes`).
        server_args: further api_server arguments (prefix caching, limits, `--kv-transfer-config`).
        allocator: a library to LD_PRELOAD (see allocator_library), or None.

    Returns:
        (the server process, its port).
    """
    port = free_port()
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", SERVED_MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(kv_cache_bytes), *server_args]
    with open(log, "wb") as out:
        process = subprocess.Popen(args, env=server_env(allocator), stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text(errors='replace')[-3000:]}")
        try:
            if request(port, "GET", "/health", None, timeout=2)[0] == 200:
                return process, port
        except OSError:
            time.sleep(1)
    stop_server(process)
    raise RuntimeError("the server did not become healthy")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def request(port: int, method: str, path: str, body: dict | None, timeout: float = 300):
    """(status, body bytes) of one plain HTTP call to the server."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, None if body is None else json.dumps(body),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def read_metrics(port: int) -> list[tuple[str, dict[str, str], float]]:
    """The server's Prometheus samples: (name, labels, value) for each line of /metrics."""
    _, raw = request(port, "GET", "/metrics", None)
    samples = []
    for line in raw.decode().splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)$", line)
        if match is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def scrape(port: int) -> dict:
    """Fallbacks by reason and preemptions, summed over the server's engines."""
    fallbacks, preemptions = {}, 0.0
    for name, labels, value in read_metrics(port):
        if name == "vllm:cachefuse_requests_fallback_total":
            fallbacks[labels["reason"]] = fallbacks.get(labels["reason"], 0) + value
        elif name == "vllm:num_preemptions_total":
            preemptions += value
    return {"fallbacks_by_reason": fallbacks, "preemptions": preemptions}


def server_counters(port: int) -> dict[str, float]:
    """Cumulative counters: cachefuse's by name (fallbacks as `requests_fallback:<reason>`), preemptions,
    prefix cache queries and hits (vLLM's own cache, then a connector's as `external_`)."""
    tracked = {"vllm:num_preemptions_total": "preemptions",
               "vllm:prefix_cache_queries_total": "prefix_cache_queries",
               "vllm:prefix_cache_hits_total": "prefix_cache_hits",
               "vllm:external_prefix_cache_queries_total": "external_prefix_cache_queries",
               "vllm:external_prefix_cache_hits_total": "external_prefix_cache_hits"}
    counters: dict[str, float] = {}
    for name, labels, value in read_metrics(port):
        if name.startswith("vllm:cachefuse_") and name.endswith("_total"):
            key = name.removeprefix("vllm:cachefuse_").removesuffix("_total")
            key = f"{key}:{labels['reason']}" if "reason" in labels else key
        elif name in tracked:
            key = tracked[name]
        else:
            continue
        counters[key] = counters.get(key, 0.0) + value
    return counters


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items() if value != before.get(key, 0.0)}


def wait_until_idle(port: int) -> None:
    """Waits (at most IDLE_WAIT_S) until the server runs and queues nothing: cancelled stragglers of the
    last point must not load the next one."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while time.monotonic() < deadline:
        busy = sum(value for name, _, value in read_metrics(port)
                   if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
        if busy == 0:
            return
        time.sleep(0.5)

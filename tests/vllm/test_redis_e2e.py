"""Engines sharing one Redis store, and a Redis that fails under a serving engine.

- what one engine (a separate process) saves, another engine hits after its index refresh;
- Redis answering through a proxy that resets connections, paused (CLIENT PAUSE) or stopped: the
  request completes with plain vLLM's output (every chunk is a miss, so the blend pass computes the
  whole prompt), the scheduler's planning does not touch the network, and the engine hits again once
  Redis is back.

Time bounds here are hang guards far above the configured timeouts, never speed checks.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from tests.helpers.redis_server import DroppingProxy, RedisServer
from tests.helpers.tolerances import LOGPROB_TOL
from tests.helpers.vllm_engines import (
    first_logprobs,
    generate,
    max_logprob_diff,
    named_prompt,
    precompute,
    random_pieces,
    scheduler_connector,
    start_engine,
    stop_engine,
    worker_side,
)

PEER = Path(__file__).with_name("redis_peer.py")
HANG_GUARD_S = 60.0


@pytest.fixture(scope="module")
def family():
    return "llama"


@pytest.fixture(scope="module")
def pieces():
    return random_pieces(17, {"system": 11, "a": 29, "b": 24, "c": 22, "question": 7})


def prompt(pieces, names, **overrides):
    return named_prompt(pieces, names, selector="cacheblend", recompute_ratio=0.15, **overrides)


@pytest.fixture(scope="module")
def shared(tiny_model_dir, tmp_path_factory):
    """A private Redis behind a proxy, and an engine whose only tier is that Redis."""
    server = RedisServer().start()
    proxy = DroppingProxy(server.port)
    store_dir = tmp_path_factory.mktemp("redis-engine")
    llm = start_engine(tiny_model_dir("llama"), store_dir, redis_url=proxy.url(), memory_capacity_bytes=0,
                       disk_capacity_bytes=0, redis_timeout_s=0.3, index_refresh_interval_s=0.2)
    yield SimpleNamespace(server=server, proxy=proxy, llm=llm, model_dir=tiny_model_dir("llama"))
    stop_engine(llm)
    proxy.close()
    server.close()


def run(llm, ids, params):
    start = time.monotonic()
    (out,) = generate(llm, [ids], [params])
    assert time.monotonic() - start < HANG_GUARD_S
    return first_logprobs(out), (out.kv_transfer_params or {}).get("cachefuse")


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_what_another_engine_saves_hits_after_the_refresh(shared, pieces):
    ids, params = prompt(pieces, ["system", "a", "b", "question"])
    key_b = worker_side().engine.meta_key(pieces["b"])
    index = scheduler_connector(shared.llm)._scheduler.index
    assert key_b not in index
    requests = [{"ids": ids, "chunks": params["cachefuse"]["chunks"]}]  # every chunk a hole there: all saved
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out = subprocess.run([sys.executable, str(PEER), str(shared.model_dir), shared.proxy.url(), json.dumps(requests)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    (peer,) = [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")][0]
    assert peer["holes_saved"] == 3, peer  # system, a, b
    wait_until(lambda: key_b in index, "the index refresh")  # no request needed: the background thread
    (variant,) = index.variants(key_b)
    assert variant.has_stats and variant.prefix == (worker_side().engine.meta_key(pieces["a"]),)
    fused, stats = run(shared.llm, ids, params)
    assert stats["status"] == "fused" and stats["chunks_hit"] == 3 and stats["chunks_missed"] == 0, stats
    assert stats["load_bytes_by_tier"].get("redis", 0) > 0 and stats["chunk_cfo"][2] == 0.0, stats
    plain, _ = run(shared.llm, ids, None)
    assert max_logprob_diff(plain, fused) < 0.5  # the same model: a near answer (0.15 blend, not exact)


def assert_plain_output(shared, pieces, label: str, **overrides):
    ids, params = prompt(pieces, ["system", "a", "c", "question"], **overrides)
    fused, stats = run(shared.llm, ids, params)
    plain, _ = run(shared.llm, ids, None)
    assert stats["status"] == "fused" and stats["chunks_hit"] == 0 and stats["chunks_missed"] == 3, (label, stats)
    assert max_logprob_diff(plain, fused) < LOGPROB_TOL, label  # nothing loaded: the whole prompt computed
    return stats


@contextlib.contextmanager
def redis_sends_on_this_thread(monkeypatch):
    """Records every command this thread sends to any Redis (the index refresher's thread is not counted).

    Every redis-py command, pipelined or not, goes out through `Connection.send_packed_command`.
    """
    sends, caller, original = [], threading.get_ident(), redis.connection.Connection.send_packed_command

    def recording(self, command, *args, **kwargs):
        if threading.get_ident() == caller:
            sends.append(command)
        return original(self, command, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(redis.connection.Connection, "send_packed_command", recording)
        yield sends


def test_redis_send_recorder_sees_a_command(shared, monkeypatch):
    """Negative control for the planning check below: a command from this thread is recorded."""
    with redis_sends_on_this_thread(monkeypatch) as sends:
        shared.server.client().ping()
    assert sends


def test_failing_redis_gives_plain_output_and_recovers(shared, pieces, monkeypatch):
    precompute(shared.llm, pieces["system"], [pieces["a"], pieces["c"]])
    ids, params = prompt(pieces, ["system", "a", "c", "question"])
    wait_until(lambda: worker_side().engine.meta_key(pieces["c"]) in scheduler_connector(shared.llm)._scheduler.index,
               "the saves to reach the index")
    _, stats = run(shared.llm, ids, params)
    assert stats["chunks_hit"] == 3, stats

    shared.proxy.set_mode("reset")  # every connection through the proxy is reset
    stats = assert_plain_output(shared, pieces, "connections reset", sync_save=True)
    assert stats["save_failures"] == 3  # nothing could be saved either, and nothing escaped
    shared.proxy.set_mode("forward")
    _, stats = run(shared.llm, ids, params)
    assert stats["chunks_hit"] == 3, stats  # back: the entries were never lost

    scheduler = scheduler_connector(shared.llm)._scheduler
    with shared.server.frozen():  # every call waits, then times out (0.3 s), however long the run takes
        request = SimpleNamespace(request_id="probe", prompt_token_ids=ids, kv_transfer_params=params)
        with redis_sends_on_this_thread(monkeypatch) as sends:  # planning reads only the in-process index
            assert scheduler.get_num_new_matched_tokens(request, 0)[0] == len(ids) - 1
            scheduler.request_finished(request, [])
        assert sends == []
        assert_plain_output(shared, pieces, "paused")
    # Holes queued while frozen read as stored until the writer has tried them (written or failed): a
    # queued hole served from the queue would be a hit below.
    assert worker_side().engine.saver.flush(HANG_GUARD_S)

    shared.server.stop()  # gone for good (its data with it)
    assert_plain_output(shared, pieces, "stopped")
    assert scheduler._refresher.errors >= 1  # the refresher noticed, and the index kept its snapshot
    assert worker_side().engine.meta_key(pieces["c"]) in scheduler.index

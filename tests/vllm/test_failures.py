"""Every failure path yields the output docs/architecture.md defines, counts it by reason, says why in the
response, and leaves the engine serving.

- a missing, corrupt, truncated or foreign store entry is a hole: the output equals the same
  request with that chunk computed in full (and differs from the chunk loaded);
- malformed kv_transfer_params and an exception in the blend pass give plain vLLM output;
- an unwritable store directory: saves fail and are counted (in the response of a `sync_save` request;
  at the next step when saved in the background, the scheduler's index then forgetting the variant),
  the answer equals the same request with saving working, and later requests are fine.
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest

from cachefuse.store.base import StoreIdentity
from cachefuse.store.entry_format import encode_entry
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


@pytest.fixture(scope="module")
def family():  # one family is enough here: the paths are model-independent
    return "llama"


@pytest.fixture(scope="module", params=[False, True], ids=["sync_scheduling", "async_scheduling"])
def setup(request, tiny_model_dir, tmp_path_factory):
    """Each test runs under vLLM's synchronous scheduler and its async one (vLLM's default on GPUs), where
    every blend is an asynchronous load (a failure must reach vLLM before it schedules the request)."""
    store_dir = tmp_path_factory.mktemp("failure-store")
    # Disk tier only: every request reads the files, so what a test does to a file is what it sees.
    llm = start_engine(tiny_model_dir("llama"), store_dir, async_scheduling=request.param, memory_capacity_bytes=0,
                       selector="full_reuse")
    pieces = random_pieces(3, {"system": 10, "a": 33, "c": 27, "d": 21, "question": 9})
    precompute(llm, pieces["system"], [pieces["a"], pieces["c"]])
    yield llm, store_dir, pieces
    stop_engine(llm)


def prompt(pieces, names=("system", "a", "c", "question")):
    return named_prompt(pieces, names)


@contextlib.contextmanager
def saving(enabled: bool):
    """Turns the worker's hole saving on or off for the duration (so hole scenarios stay holes)."""
    worker = worker_side()
    config = worker.config
    worker.config = config.replace(save_holes=enabled)
    try:
        yield
    finally:
        worker.config = config


def c_entry_path(store_dir: Path, pieces) -> tuple[str, Path]:
    key = worker_side().engine.key(pieces["c"])
    return key, store_dir / key[:2] / f"{key}.safetensors"


def restore_c(pieces, pristine) -> None:
    worker_side().engine.store.put(worker_side().engine.key(pieces["c"]), pristine)


def run(llm, ids, params):
    (out,) = generate(llm, [ids], [params])
    return first_logprobs(out), out.kv_transfer_params["cachefuse"] if out.kv_transfer_params else None


@pytest.fixture(scope="module")
def references(setup):
    """L: every chunk loaded; H: chunk c as a hole (its file removed after indexing); P: plain."""
    llm, store_dir, pieces = setup
    ids, params = prompt(pieces)
    key, path = c_entry_path(store_dir, pieces)
    pristine = worker_side().engine.store.get(key)
    loaded, _ = run(llm, ids, params)
    with saving(False):
        path.unlink()
        hole, stats = run(llm, ids, params)
    assert stats["miss_reasons"] == {"absent": 1} and stats["chunks_missed"] == 1, stats
    plain, _ = run(llm, ids, None)
    assert max_logprob_diff(loaded, hole) > 1e-3  # negative control: the hole is visible in the output
    restore_c(pieces, pristine)
    return dict(loaded=loaded, hole=hole, plain=plain, pristine=pristine)


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor's data: its checksum no longer matches
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def foreign(path: Path, entry) -> None:
    path.write_bytes(encode_entry(entry, StoreIdentity("another-model", entry.num_layers, entry.dtype)))


@pytest.mark.parametrize(("damage", "reason"), [("corrupt", "corrupt"), ("truncated", "truncated"),
                                                ("foreign", "foreign_model")])
def test_bad_entry_is_a_hole(setup, references, damage, reason):
    llm, store_dir, pieces = setup
    ids, params = prompt(pieces)
    _, path = c_entry_path(store_dir, pieces)
    counters = scheduler_connector(llm).counters
    before = counters[f"miss:{reason}"]
    {"corrupt": corrupt, "truncated": truncate, "foreign": lambda p: foreign(p, references["pristine"])}[damage](path)
    with saving(False):
        logprobs, stats = run(llm, ids, params)
    assert stats["status"] == "fused" and stats["miss_reasons"] == {reason: 1}, stats
    assert max_logprob_diff(references["hole"], logprobs) < 1e-5
    assert counters[f"miss:{reason}"] == before + 1
    restore_c(pieces, references["pristine"])
    logprobs, stats = run(llm, ids, params)  # the engine keeps serving, and the entry hits again
    assert stats["chunks_hit"] == 3 and max_logprob_diff(references["loaded"], logprobs) < 1e-5


MALFORMED = {
    "overlapping": ({"chunks": [[0, 10], [5, 20]]}, "cachefuse.chunks[1]"),
    "out_of_range": ({"chunks": [[0, 10], [10, 9999]]}, "cachefuse.chunks[1]"),
    "unsorted": ({"chunks": [[10, 43], [0, 10]]}, "cachefuse.chunks[1]"),
    "wrong_type_inside": ({"chunks": [[0, "10"]]}, "cachefuse.chunks[0]"),
    "not_a_list": ({"chunks": 7}, "cachefuse.chunks"),
    "bad_ratio": ({"chunks": [[0, 10]], "recompute_ratio": 2}, "cachefuse.recompute_ratio"),
    "unknown_field": ({"chunkz": [[0, 10]]}, "cachefuse.chunkz"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_request_runs_plain(setup, references, name):
    llm, _, pieces = setup
    ids, _ = prompt(pieces)
    body, field = MALFORMED[name]
    counters = scheduler_connector(llm).counters
    before = counters["fallback:malformed_request"]
    logprobs, stats = run(llm, ids, {"cachefuse": body})
    assert stats["status"] == "fallback" and stats["fallback_reason"] == "malformed_request", stats
    assert stats["field"] == field and stats["detail"]
    assert logprobs == references["plain"]  # plain vLLM, bit for bit
    assert counters["fallback:malformed_request"] == before + 1


def test_exception_in_blend_pass_falls_back_to_plain(setup, references, monkeypatch):
    llm, _, pieces = setup
    ids, params = prompt(pieces)
    counters = scheduler_connector(llm).counters
    before = counters["fallback:blend_error"]

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(worker_side().engine.fusor, "fuse_steps", broken)
    logprobs, stats = run(llm, ids, params)
    assert stats["status"] == "fallback" and stats["fallback_reason"] == "blend_error", stats
    assert "injected failure" in stats["detail"]
    assert max_logprob_diff(references["plain"], logprobs) < 1e-5  # vLLM recomputed the whole prompt
    assert counters["fallback:blend_error"] == before + 1
    monkeypatch.undo()
    logprobs, stats = run(llm, ids, params)
    assert stats["status"] == "fused" and max_logprob_diff(references["loaded"], logprobs) < 1e-5


@contextlib.contextmanager
def unwritable(directory: Path, monkeypatch):
    """Makes `directory` refuse new files, even for root (immutable attribute), or, where chattr is
    not available, makes every rename into it fail with EACCES."""
    try:
        subprocess.run(["chattr", "-R", "+i", str(directory)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        def refuse(src, dst):
            raise PermissionError(13, "Permission denied", str(dst))

        monkeypatch.setattr("cachefuse.store.disk.os.replace", refuse)
        yield
        monkeypatch.undo()
        return
    try:
        yield
    finally:
        subprocess.run(["chattr", "-R", "-i", str(directory)], check=True, capture_output=True)


def test_unwritable_store_counts_failed_saves(setup, references, monkeypatch):
    """A request asking for `sync_save` learns of the failure in its response."""
    llm, store_dir, pieces = setup
    ids, params = prompt(pieces, ("system", "a", "d", "c", "question"))  # d was never stored: a hole
    params["cachefuse"]["sync_save"] = True
    counters = scheduler_connector(llm).counters
    before = counters["save_failures"]
    with unwritable(store_dir, monkeypatch):
        failed_save, stats = run(llm, ids, params)
    assert stats["status"] == "fused" and stats["save_failures"] == 1 and stats["holes_saved"] == 0, stats
    assert counters["save_failures"] == before + 1
    saved, stats = run(llm, ids, params)  # the same request with saving working
    assert stats["holes_saved"] == 1 and stats["save_failures"] == 0, stats
    assert max_logprob_diff(saved, failed_save) < 1e-6
    _, stats = run(llm, ids, params)  # later requests are fine and hit the saved hole
    assert stats["chunks_hit"] == 4 and stats["chunks_missed"] == 0, stats


def test_a_background_save_that_fails_is_counted_and_forgotten(setup, references, monkeypatch):
    """Saved behind the response (the default), a failure reaches the counters at the next step and the
    scheduler's index forgets the variant, so the next request computes the chunk again (never a
    plan on K/V that are not there)."""
    llm, store_dir, pieces = setup
    pieces = {**pieces, **random_pieces(17, {"e": 23})}  # e: stored nowhere, so a hole
    ids, params = prompt(pieces, ("system", "a", "e", "c", "question"))
    engine = worker_side().engine
    counters = scheduler_connector(llm).counters
    before = counters["save_failures"]
    with unwritable(store_dir, monkeypatch):
        failed_save, stats = run(llm, ids, params)
        assert stats["status"] == "fused" and stats["holes_saved"] == 1 and stats["saves_skipped"] == 0, stats
        assert engine.saver.flush(60.0)  # written (and refused) while the store is unwritable
    _, stats = run(llm, ids, params)  # the next step carries the failure to the scheduler
    assert counters["save_failures"] == before + 1
    assert stats["chunks_missed"] == 1 and stats["holes_saved"] == 1, stats  # computed again, saved now
    assert engine.saver.flush(60.0)
    again, stats = run(llm, ids, params)
    assert stats["chunks_hit"] == 4 and stats["chunks_missed"] == 0, stats
    assert max_logprob_diff(again, failed_save) < 1e-6


def test_a_full_save_queue_skips_the_save_and_says_so(setup, references):
    """A hole that does not fit in the writer's queue is skipped and counted, in the response and the
    counters; the request's answer is unchanged and the chunk is simply not stored."""
    llm, _, pieces = setup
    pieces = {**pieces, **random_pieces(19, {"f": 17})}  # f: stored nowhere, so a hole
    ids, params = prompt(pieces, ("system", "a", "f", "c", "question"))
    saver = worker_side().engine.saver
    counters = scheduler_connector(llm).counters
    before = counters["saves_skipped"]
    saver.max_bytes, bound = 1, saver.max_bytes
    try:
        skipped, stats = run(llm, ids, params)
    finally:
        saver.max_bytes = bound
    assert stats["holes_saved"] == 0 and stats["saves_skipped"] == 1, stats
    assert counters["saves_skipped"] == before + 1
    saved, stats = run(llm, ids, params)  # not stored: a hole again, saved this time
    assert stats["chunks_missed"] == 1 and stats["holes_saved"] == 1, stats
    assert max_logprob_diff(saved, skipped) < 1e-6

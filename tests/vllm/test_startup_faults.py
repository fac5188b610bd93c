"""Start-up survives a damaged metadata store: a corrupt or truncated meta.sqlite, or something else
under its name, and the engine starts, says so in its log, and fuses from the K/V files (metadata for
this run in memory); a Redis that is down at start-up is answered once it is up (tests/metadata)."""

from __future__ import annotations

import logging

import pytest

from tests.helpers.vllm_engines import (
    generate,
    named_prompt,
    precompute,
    random_pieces,
    start_engine,
    stop_engine,
)


@pytest.fixture(scope="module")
def family():  # model-independent
    return "llama"


def _corrupt(path):
    path.write_bytes(b"not a database" * 64)


def _truncated(path):
    path.write_bytes(path.read_bytes()[:1000])


def _a_directory(path):
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize("damage", [_corrupt, _truncated, _a_directory])
def test_an_engine_starts_and_fuses_over_a_damaged_metadata_file(tiny_model_dir, tmp_path, caplog, damage):
    pieces = random_pieces(17, {"system": 12, "a": 30, "b": 25, "question": 8})
    llm = start_engine(tiny_model_dir("llama"), tmp_path)
    precompute(llm, pieces["system"], [pieces["a"], pieces["b"]])  # K/V files and their metadata rows
    stop_engine(llm)
    damage(tmp_path / "meta.sqlite")

    with caplog.at_level(logging.WARNING, logger="cachefuse"):
        llm = start_engine(tiny_model_dir("llama"), tmp_path)  # failed to start before
    try:
        assert "variant metadata store unavailable" in caplog.text
        ids, params = named_prompt(pieces, ("system", "a", "b", "question"))
        (output,) = generate(llm, [ids], [params])
        stats = output.kv_transfer_params["cachefuse"]
        assert stats["status"] == "fused" and stats["chunks_hit"] == 3  # the files serve as base variants
    finally:
        stop_engine(llm)


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_store_dir_that_cannot_be_a_directory_runs_on_metadata_in_memory(tmp_path, caplog, where):
    """A `store_dir` that is a file (or under one) stopped the worker with a bare FileExistsError /
    NotADirectoryError; it is now the same store failure as a damaged meta.sqlite: warned, and served
    with this run's metadata in memory (the disk tier warns for its part and refuses puts)."""
    from cachefuse.config import CacheFuseConfig
    from cachefuse.metadata.sqlite import SqliteMetaStore
    from cachefuse.vllm.worker_side import _open_metastore

    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    store_dir = blocker if where == "a file" else blocker / "store"
    with caplog.at_level(logging.WARNING, logger="cachefuse"):
        store = _open_metastore(CacheFuseConfig(store_dir=str(store_dir)))
    try:
        assert isinstance(store, SqliteMetaStore) and "variant metadata store unavailable" in caplog.text
        assert f"store_dir {str(store_dir)!r} cannot be used as a directory" in caplog.text
    finally:
        store.close()

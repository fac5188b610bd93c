"""DiskStore: file format, atomic writes (a crash before the rename), bad files as misses, LRU, pins, I/O."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from cachefuse.errors import StoreError
from cachefuse.store import disk, entry_format
from cachefuse.store.base import MAX_ENTRY_HEADER_BYTES, ChunkKV, KVStore, StoreIdentity
from cachefuse.store.disk import DiskStore
from cachefuse.store.entry_format import encode_entry
from cachefuse.store.memory import MemoryStore
from cachefuse.store.tiered import TieredStore
from tests.helpers.store import IDENTITY, IDENTITY_BF16, OPS, assert_same_entry, make_entry, run_ops

REPO_ROOT = Path(__file__).resolve().parents[2]
KEY = "ab12cd"
BIG = 1 << 24


def file_size(num_tokens: int) -> int:
    return len(encode_entry(make_entry(num_tokens), IDENTITY))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(disk.TMP_PREFIX)]


def data_start(path: Path) -> int:
    """Offset of the first tensor byte: 8-byte header length, then the JSON header."""
    (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8 + header_len


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_round_trip_and_file_format(tmp_path, dtype, num_tokens):
    identity = IDENTITY if dtype == torch.float32 else IDENTITY_BF16
    store = DiskStore(tmp_path, identity, BIG)
    entry = make_entry(num_tokens, dtype, meta={"prefix": "c1,c2", "variant": "base"})
    assert store.put(KEY, entry)
    assert_same_entry(store.get(KEY), entry)
    layer = store.get_layer(KEY, 2)
    assert torch.equal(layer[0], entry.k_nope[2]) and torch.equal(layer[1], entry.v[2])

    path = tmp_path / KEY[:2] / f"{KEY}.safetensors"
    with safe_open(path, framework="pt") as f:
        header = f.metadata()
        assert sorted(f.keys()) == sorted(f"{kv}.{i}" for kv in "kv" for i in range(3))
    assert header["format"] == "cachefuse-kv" and header["format_version"] == "1"
    assert header["model_fingerprint"] == "fp-test" and header["num_layers"] == "3"
    assert header["dtype"] == str(dtype).removeprefix("torch.") and header["num_tokens"] == str(num_tokens)
    assert header["checksum.v.1"] == entry_format.checksum(entry.v[1]) and header["meta.variant"] == "base"
    assert store.nbytes == path.stat().st_size and store.stats.bytes_written == store.nbytes
    assert temp_files(tmp_path) == []

    reopened = DiskStore(tmp_path, identity, BIG)  # the scan finds it; contains does no I/O
    assert reopened.contains(KEY) and reopened.keys() == [KEY]
    assert_same_entry(reopened.get(KEY), entry)


def test_reads_leave_the_file_byte_identical(tmp_path):
    store = DiskStore(tmp_path, IDENTITY, BIG)
    entry = make_entry(11)
    store.put(KEY, entry)
    path = tmp_path / KEY[:2] / f"{KEY}.safetensors"
    before = sha256(path)
    got = store.get(KEY)
    mine = got.k_nope[0].clone()
    mine.mul_(2.0)
    got.v[1].add_(1.0)  # even writing into a returned tensor cannot reach the stored bytes
    layer_k, _ = store.get_layer(KEY, 0)
    layer_k.zero_()
    assert sha256(path) == before
    assert_same_entry(store.get(KEY), entry)


def test_lru_by_access_survives_a_restart(tmp_path):
    size = file_size(5)
    store = DiskStore(tmp_path, IDENTITY, 3 * size)
    for i, key in enumerate(["aa01", "aa02", "aa03"]):
        assert store.put(key, make_entry(5, seed=i))
    assert store.get("aa01") is not None  # aa02 becomes the least recently used
    reopened = DiskStore(tmp_path, IDENTITY, 3 * size)
    assert reopened.keys() == ["aa02", "aa03", "aa01"]
    assert reopened.put("aa04", make_entry(5, seed=4))
    assert reopened.keys() == ["aa03", "aa01", "aa04"] and reopened.stats.evictions == 1
    assert not (tmp_path / "aa" / "aa02.safetensors").exists()
    smaller = DiskStore(tmp_path, IDENTITY, 2 * size)  # the scan enforces a lowered capacity
    assert smaller.keys() == ["aa01", "aa04"] and smaller.nbytes <= 2 * size


def test_pins_nest_and_block_eviction(tmp_path):
    store = DiskStore(tmp_path, IDENTITY, 2 * file_size(5))
    store.put("aa01", make_entry(5, seed=1))
    store.pin("aa01")
    store.pin("aa01")
    store.unpin("aa01")
    for i in range(2, 5):
        assert store.put(f"aa0{i}", make_entry(5, seed=i))
    assert store.contains("aa01")
    with store.pinned(["aa04"]):
        assert not store.put("aa05", make_entry(5, seed=5))  # both resident entries are pinned
    store.unpin("aa01")
    assert store.put("aa05", make_entry(5, seed=5)) and not store.contains("aa01")
    assert not store.put("aa06", make_entry(40))  # larger than the whole capacity
    assert store.stats.put_failures == 2


def test_crash_between_write_and_rename_leaves_no_entry(tmp_path):
    child = textwrap.dedent(
        f"""
        import os, sys, torch
        from cachefuse.store.base import ChunkKV, StoreIdentity
        from cachefuse.store.disk import DiskStore
        identity = StoreIdentity("fp-test", 3, torch.float32)
        store = DiskStore(sys.argv[1], identity, 1 << 24, _before_rename=lambda tmp: os._exit(17))
        entry = ChunkKV([torch.ones(5, 2, 8)] * 3, [torch.ones(5, 2, 6)] * 3)
        store.put({KEY!r}, entry)
        os._exit(0)  # not reached: the hook ends the process first
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-c", child, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=120)
    assert proc.returncode == 17, proc.stderr.decode()[-2000:]
    assert len(temp_files(tmp_path)) == 1  # the fully written temp file, never renamed

    store = DiskStore(tmp_path, IDENTITY, BIG)
    assert not store.contains(KEY) and store.get(KEY) is None and store.keys() == []
    # Fresh, it may be another process's write in flight (precompute beside a server): a start-up keeps it
    [leftover] = temp_files(tmp_path)
    old = time.time() - disk.STALE_TEMP_S - 1
    os.utime(leftover, (old, old))
    store = DiskStore(tmp_path, IDENTITY, BIG)  # old enough: a dead writer's, deleted
    assert temp_files(tmp_path) == [] and store.keys() == []
    assert store.put(KEY, make_entry(5)) and store.get(KEY) is not None


def test_a_start_up_leaves_another_process_write_in_flight_alone(tmp_path):
    """A store starting (or restarting) beside another process's put, between its fsync and its rename,
    must not delete that temp file (it did: the put then failed with FileNotFoundError)."""
    writer = DiskStore(tmp_path, IDENTITY, BIG)
    started = []
    writer._before_rename = lambda tmp: started.append(DiskStore(tmp_path, IDENTITY, BIG))
    assert writer.put(KEY, make_entry(5))
    assert len(started) == 1 and writer.get(KEY) is not None and temp_files(tmp_path) == []


def test_failed_overwrite_keeps_the_old_entry(tmp_path):
    def fail(tmp: Path) -> None:
        raise OSError(errno.EIO, "simulated I/O error before rename")

    DiskStore(tmp_path, IDENTITY, BIG).put(KEY, make_entry(5, seed=1))
    store = DiskStore(tmp_path, IDENTITY, BIG, _before_rename=fail)
    assert not store.put(KEY, make_entry(5, seed=2))
    assert store.stats.put_failures == 1 and temp_files(tmp_path) == []
    assert_same_entry(store.get(KEY), make_entry(5, seed=1))


def _flip_data_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[data_start(path) + 3] ^= 0xFF
    path.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def _truncate_header(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:20])


def _pad_header(path: Path, nbytes: int) -> None:
    """The entry's own header, still valid JSON, with `nbytes` of spaces after it."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = raw[8:8 + header_len] + b" " * nbytes
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + header_len:])


def _nest_header(path: Path) -> None:
    header = b"[" * 100_000 + b"]" * 100_000  # nested past the JSON parser's depth
    path.write_bytes(struct.pack("<Q", len(header)) + header)


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(300))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _write_as(identity: StoreIdentity, num_layers: int = 3, dtype=torch.float32):
    def write(path: Path) -> None:
        path.write_bytes(encode_entry(make_entry(5, dtype, num_layers=num_layers), identity))

    return write


@pytest.mark.parametrize(
    "damage, reason",
    [
        (_flip_data_byte, "corrupt"),
        (_truncate, "truncated"),
        (_truncate_header, "truncated"),
        (_garbage, "corrupt"),
        (_nest_header, "corrupt"),
        (_empty, "truncated"),
        (_write_as(StoreIdentity("other-model", 3, torch.float32)), "foreign_model"),
        (_write_as(IDENTITY_BF16, dtype=torch.bfloat16), "foreign_model"),
        (_write_as(StoreIdentity("fp-test", 4, torch.float32), num_layers=4), "shape_mismatch"),
        (lambda path: path.unlink(), "absent"),
    ],
    ids=["flipped", "truncated", "truncated-header", "garbage", "nested-header", "empty", "fingerprint", "dtype", "layers",
         "deleted"],
)
def test_bad_files_are_counted_misses(tmp_path, damage, reason):
    store = DiskStore(tmp_path, IDENTITY, BIG)
    store.put(KEY, make_entry(5))
    path = tmp_path / KEY[:2] / f"{KEY}.safetensors"
    damage(path)
    assert store.contains(KEY)  # the index does no I/O, so it cannot know yet
    assert store.get(KEY) is None
    assert store.stats.misses == {reason: 1}
    assert not store.contains(KEY) and not path.exists()  # bad entries leave the index and the disk
    assert store.get(KEY) is None and store.stats.misses.get("absent", 0) == 1 + (reason == "absent")
    assert store.put(KEY, make_entry(5, seed=3))
    assert_same_entry(store.get(KEY), make_entry(5, seed=3))


def test_a_header_past_the_shared_cap_is_not_parsed(tmp_path):
    """The disk tier parsed headers up to 100 MiB (~2.3 GB of Python objects); every tier now stops at
    MAX_ENTRY_HEADER_BYTES, below a budget that would admit the file."""
    store = DiskStore(tmp_path, IDENTITY, 4 * MAX_ENTRY_HEADER_BYTES)
    path = tmp_path / KEY[:2] / f"{KEY}.safetensors"
    store.put(KEY, make_entry(5))
    _pad_header(path, 1 << 20)  # control: a padded header under the cap is read as before
    assert_same_entry(store.get(KEY), make_entry(5))
    _pad_header(path, MAX_ENTRY_HEADER_BYTES)
    assert store.get(KEY) is None and store.stats.misses == {"corrupt": 1}


def test_bad_file_found_by_the_scan_is_a_miss(tmp_path):
    path = tmp_path / KEY[:2] / f"{KEY}.safetensors"
    path.parent.mkdir()
    _write_as(StoreIdentity("other-model", 3, torch.float32))(path)
    (path.parent / "notes.txt").write_text("stray files are ignored")
    store = DiskStore(tmp_path, IDENTITY, BIG)
    assert store.keys() == [KEY]
    assert store.get(KEY) is None and store.stats.misses == {"foreign_model": 1}


def test_get_layer_verifies_only_the_layer_it_reads(tmp_path):
    store = DiskStore(tmp_path, IDENTITY, BIG)
    entry = make_entry(5)
    store.put(KEY, entry)
    path = tmp_path / KEY[:2] / f"{KEY}.safetensors"
    raw = bytearray(path.read_bytes())
    header = json.loads(raw[8:data_start(path)])
    start, _ = header["k.1"]["data_offsets"]
    raw[data_start(path) + start] ^= 0x01  # one bit of layer 1's K
    path.write_bytes(bytes(raw))
    k0, v0 = store.get_layer(KEY, 0)
    assert torch.equal(k0, entry.k_nope[0]) and torch.equal(v0, entry.v[0])
    assert store.get_layer(KEY, 1) is None and store.stats.misses == {"corrupt": 1}
    with pytest.raises(IndexError):
        store.get_layer(KEY, 3)


def test_io_error_is_a_miss_that_keeps_the_entry(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, IDENTITY, BIG)
    store.put(KEY, make_entry(5))

    def broken_open(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(entry_format, "_open_entry", broken_open)
    assert store.get(KEY) is None and store.stats.misses == {"io_error": 1}
    assert store.contains(KEY)
    monkeypatch.undo()
    assert_same_entry(store.get(KEY), make_entry(5))


def _check_put_fails(store: DiskStore) -> None:
    assert not store.put(KEY, make_entry(5))
    assert store.stats.put_failures == 1 and not store.contains(KEY) and store.get(KEY) is None


def test_read_only_root_fails_puts(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    store = DiskStore(root, IDENTITY, BIG)
    root.chmod(0o500)
    try:
        if os.access(root, os.W_OK):
            pytest.skip("running as root: chmod does not stop writes (see the other unwritable-root tests)")
        _check_put_fails(store)
    finally:
        root.chmod(0o700)


def test_root_that_is_a_file_fails_puts(tmp_path):
    root = tmp_path / "not-a-dir"
    root.write_text("")
    _check_put_fails(DiskStore(root, IDENTITY, BIG))


def test_permission_error_on_rename_fails_puts(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, IDENTITY, BIG)

    def deny(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", str(dst))

    monkeypatch.setattr(os, "replace", deny)
    _check_put_fails(store)
    monkeypatch.undo()
    assert temp_files(tmp_path) == []
    assert store.put(KEY, make_entry(5)) and store.contains(KEY)


def test_bad_keys_raise_and_protocol_holds(tmp_path):
    store = DiskStore(tmp_path, IDENTITY, BIG)
    for key in ["../x", "a", ".tmp-ab", "ab/cd", ""]:
        with pytest.raises(StoreError):
            store.put(key, make_entry(5))
    assert isinstance(store, KVStore)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, capacity=st.sampled_from([0, 2000, 3500, 6000]))
def test_matches_reference_model(ops, capacity):
    with tempfile.TemporaryDirectory() as root:
        store = DiskStore(root, IDENTITY, capacity)
        run_ops(store, ops, size_of=lambda entry: len(encode_entry(entry, IDENTITY)))


def test_aliased_tensors_are_stored(tmp_path):
    shared_k, shared_v = torch.randn(4, 2, 8), torch.randn(4, 2, 6)
    one_for_all = ChunkKV([shared_k] * 3, [shared_v] * 3)  # one tensor object for every layer
    buf = torch.randn(3, 4, 2, 8)  # [num_layers, num_tokens, num_kv_heads, head_dim]
    views = ChunkKV([buf[0], buf[1], buf[2]], [shared_v, shared_v.clone(), shared_v])  # slices of one storage
    store = DiskStore(tmp_path, IDENTITY, BIG)
    assert store.put(KEY, one_for_all) and store.put("ab99", views)
    assert_same_entry(store.get(KEY), one_for_all)
    assert_same_entry(store.get("ab99"), views)


def test_a_header_claiming_gigabytes_in_a_sparse_file_is_refused_before_any_tensor_is_read(tmp_path, monkeypatch):
    """A crafted entry: a valid header whose tensors claim 1 GiB per layer, in a sparse file of that
    apparent size that holds a few blocks. It must be a miss before a single tensor is allocated: the
    file is larger than the tier's whole budget, so no put of this tier wrote it."""
    store = DiskStore(tmp_path, IDENTITY, BIG)
    store.put(KEY, make_entry(5))
    path = store._path(KEY)
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    num_tokens, heads, dim = 1 << 20, 16, 16  # 1 GiB of float32 per tensor
    metadata["num_tokens"] = str(num_tokens)
    header, offset = {"__metadata__": metadata}, 0
    for layer in range(IDENTITY.num_layers):
        for kv in "kv":
            size = num_tokens * heads * dim * 4
            header[f"{kv}.{layer}"] = {"dtype": "F32", "shape": [num_tokens, heads, dim],
                                       "data_offsets": [offset, offset + size]}
            offset += size
    blob = json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        fh.truncate(8 + len(blob) + offset)  # sparse: the apparent size, almost no blocks
    read = []
    monkeypatch.setattr(entry_format, "read_tensor", lambda *args: read.append(args) or None)
    assert store.get(KEY) is None and read == []
    assert store.stats.misses == {"corrupt": 1} and not path.exists()


class _StatWithFewBlocks:
    """A stat result whose st_blocks is `blocks(st)`; every other field is the real one."""

    def __init__(self, st: os.stat_result, blocks) -> None:
        self._st, self.st_blocks = st, blocks(st)

    def __getattr__(self, name: str):
        return getattr(self._st, name)


@pytest.mark.parametrize("blocks", [lambda st: 1, lambda st: st.st_size // 1024],
                         ids=["zfs-before-txg-commit", "compressed-or-sparse-copy"])
def test_an_intact_entry_is_served_whatever_blocks_its_file_reports(tmp_path, monkeypatch, blocks):
    """ZFS reports st_blocks=1 for a file written and fsynced moments ago (until its transaction group
    commits), and with compression (or after `cp --sparse`) st_blocks * 512 stays below st_size: the
    entry is intact all the same and must be served, not deleted as "corrupt"."""
    store = DiskStore(tmp_path, IDENTITY, BIG)
    entry = make_entry(64)
    assert store.put(KEY, entry)
    for name in ("stat", "lstat", "fstat"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *args, real=real, **kwargs:
                            _StatWithFewBlocks(real(*args, **kwargs), blocks))
    assert os.stat(store._path(KEY)).st_blocks * 512 < os.stat(store._path(KEY)).st_size  # the simulation holds
    assert_same_entry(store.get(KEY), entry)
    assert_same_entry(DiskStore(tmp_path, IDENTITY, BIG).get(KEY), entry)  # and after a restart's scan
    assert store.stats.misses == {} and store._path(KEY).exists()


def test_a_sparse_file_within_the_budget_is_a_corrupt_miss(tmp_path):
    """A hole where tensor bytes should be reads as zeros, which the checksums refuse."""
    store = DiskStore(tmp_path, IDENTITY, BIG)
    store.put(KEY, make_entry(64))
    path = store._path(KEY)
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(data_start(path))
        fh.truncate(size)  # the same apparent size, the data a hole
    assert store.get(KEY) is None and store.stats.misses == {"corrupt": 1} and not path.exists()


def test_a_served_entry_does_not_change_when_its_file_is_rewritten_in_place(tmp_path):
    """What a read hands out owns its memory: a file rewritten in place after the checksums passed (not
    by a rename) cannot change K/V already served, nor what the memory tier keeps of a promoted hit."""
    disk = DiskStore(tmp_path, IDENTITY, BIG)
    store = TieredStore([MemoryStore(IDENTITY, BIG), disk])
    entry = make_entry(64)
    disk.put(KEY, entry)
    served, layer = disk.get(KEY), disk.get_layer(KEY, 0)
    promoted = store.get(KEY)  # a disk hit, promoted into memory as it was read
    path = disk._path(KEY)
    with open(path, "r+b") as fh:  # every tensor byte zeroed, the file never replaced
        fh.seek(data_start(path))
        fh.write(bytes(path.stat().st_size - data_start(path)))
    assert_same_entry(served, entry)
    assert_same_entry(promoted, entry)
    assert torch.equal(layer[0], entry.k_nope[0]) and torch.equal(layer[1], entry.v[0])
    assert_same_entry(store.get(KEY), entry)
    assert store.last_hit_tier == "memory"


def test_a_file_truncated_after_a_read_changes_nothing_served(tmp_path):
    """A tensor mapping a file that is cut afterwards reads zeros where its pages were dropped, or raises
    SIGBUS where they must be faulted in again (the worker dies). In a child process, so that a SIGBUS
    fails this test rather than ending the test run."""
    child = textwrap.dedent(
        f"""
        import os, sys, torch
        from cachefuse.store.base import StoreIdentity
        from cachefuse.store.disk import DiskStore
        from tests.helpers.store import IDENTITY, make_entry
        store = DiskStore(sys.argv[1], IDENTITY, 1 << 24)
        entry = make_entry(4096)
        store.put({KEY!r}, entry)
        got = store.get({KEY!r})
        os.truncate(store._path({KEY!r}), 100)
        same = all(torch.equal(a, b) for a, b in zip(got.k_nope + got.v, entry.k_nope + entry.v))
        sys.exit(0 if same else 3)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-c", child, str(tmp_path)], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr.decode()[-2000:])


def test_a_file_cut_during_a_read_is_a_truncated_miss(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, IDENTITY, BIG)
    store.put(KEY, make_entry(64))
    path = store._path(KEY)
    real_read_header = entry_format._read_header

    def read_header_then_cut(fh, size):
        found = real_read_header(fh, size)
        os.truncate(path, data_start(path) + 10)  # another process cuts the file under this read
        return found

    monkeypatch.setattr(entry_format, "_read_header", read_header_then_cut)
    assert store.get(KEY) is None and store.stats.misses == {"truncated": 1} and not path.exists()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps (Linux)")
def test_evicted_files_are_freed_while_the_memory_tier_holds_their_entries(tmp_path):
    """Entries promoted from disk into memory must not map their files: an evicted file stays allocated
    on disk as long as a mapping of it lives, so the disk tier would exceed its budget by up to the
    memory tier's."""
    size = file_size(64)
    disk_tier = DiskStore(tmp_path, IDENTITY, 4 * size)
    store = TieredStore([MemoryStore(IDENTITY, BIG), disk_tier])
    for i in range(4):
        disk_tier.put(f"ol{i:03d}", make_entry(64, seed=i))
        assert store.get(f"ol{i:03d}") is not None  # promoted into memory
    for i in range(4):
        disk_tier.put(f"nw{i:03d}", make_entry(64, seed=10 + i))  # evicts every ol* file
    assert disk_tier.keys() == [f"nw{i:03d}" for i in range(4)] and all(store.tiers[0].contains(f"ol{i:03d}")
                                                                        for i in range(4))
    maps = Path("/proc/self/maps").read_text()
    assert [line for line in maps.splitlines() if str(tmp_path) in line] == []


def test_symbolic_links_inside_the_root_are_never_followed(tmp_path):
    """A shard directory or an entry file that is a link (planted by another user, or a mistake) would
    make the tier index, stamp, overwrite and evict files outside its root."""
    outside = tmp_path / "outside"
    victim_dir = outside / "ab"
    victim_dir.mkdir(parents=True)
    DiskStore(outside, IDENTITY, BIG).put(KEY, make_entry(5, seed=1))  # a valid entry, outside the root
    victim = victim_dir / f"{KEY}{disk.SUFFIX}"
    before = (victim.read_bytes(), victim.stat().st_mtime_ns)
    root = tmp_path / "root"
    root.mkdir()
    (root / "ab").symlink_to(victim_dir, target_is_directory=True)  # a linked shard directory
    (root / "cd").mkdir()
    linked_file = root / "cd" / f"cd{KEY[2:]}{disk.SUFFIX}"
    linked_file.symlink_to(victim)  # a linked entry file

    store = DiskStore(root, IDENTITY, BIG)
    assert store.keys() == [] and disk.list_keys(root) == set()  # neither is indexed
    assert store.get(KEY) is None and store.get(f"cd{KEY[2:]}") is None
    assert not store.put(KEY, make_entry(5, seed=2))  # writing through the linked shard directory fails
    assert store.put("ef0123", make_entry(3, seed=3))
    store.remove(KEY)
    store.remove(f"cd{KEY[2:]}")
    assert (victim.read_bytes(), victim.stat().st_mtime_ns) == before  # untouched
    assert linked_file.is_symlink()


def test_files_are_owner_only(tmp_path):
    from cachefuse.metadata.sqlite import SqliteMetaStore

    store = DiskStore(tmp_path / "store", IDENTITY, BIG)
    store.put(KEY, make_entry(5))
    assert (tmp_path / "store").stat().st_mode & 0o777 == 0o700
    assert store._path(KEY).parent.stat().st_mode & 0o777 == 0o700
    assert store._path(KEY).stat().st_mode & 0o777 == 0o600
    SqliteMetaStore(str(tmp_path / "store" / "meta.sqlite"), max_variants=10).close()
    assert (tmp_path / "store" / "meta.sqlite").stat().st_mode & 0o777 == 0o600


def test_a_slow_write_never_blocks_reads_of_other_keys(tmp_path, monkeypatch):
    """The temp file is written and fsynced outside the store's lock: while one put waits on the disk,
    another thread reads (and writes) other keys. Inside the lock, the read would wait for the gate."""
    store = DiskStore(tmp_path, IDENTITY, BIG)
    other = "0" * 32
    assert store.put(other, make_entry(5, seed=1))
    gate, in_fsync = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        if threading.current_thread().name == "slow-put":
            in_fsync.set()
            assert gate.wait(60)
        real_fsync(fd)

    monkeypatch.setattr("cachefuse.store.disk.os.fsync", slow_fsync)
    writer = threading.Thread(target=store.put, args=(KEY, make_entry(5, seed=2)), name="slow-put", daemon=True)
    writer.start()
    assert in_fsync.wait(60)
    try:
        assert_same_entry(store.get(other), make_entry(5, seed=1))  # would wait for the gate under the lock
        assert store.put("1" * 32, make_entry(5, seed=3)) and not store.contains(KEY)
    finally:
        gate.set()
    writer.join(60)
    assert_same_entry(store.get(KEY), make_entry(5, seed=2))


def test_an_entry_another_process_writes_later_is_indexed_when_asked_for(tmp_path):
    """A server's disk tier scans once at start; `cachefuse precompute` (another process, another DiskStore
    on the same directory) writes entries afterwards. Asking for one indexes it, within the budget."""
    entry, other = make_entry(5, seed=1), make_entry(5, seed=2)
    size = file_size(5)
    server = DiskStore(tmp_path, IDENTITY, 2 * size)
    assert server.put("cd34ef", other)
    writer = DiskStore(tmp_path, IDENTITY, BIG)  # the other process
    assert writer.put(KEY, entry) and writer.put("ef5678", make_entry(5, seed=3))
    assert server.keys() == ["cd34ef"]  # not scanned again
    assert server.contains(KEY) and server.keys() == ["cd34ef", KEY]
    assert_same_entry(server.get(KEY), entry)
    assert server.contains("ef5678") and not server.contains("cd34ef")  # the budget holds: LRU evicted
    assert not server.contains("0a0b0c")  # nothing there: one stat, no index entry
    link_dir = tmp_path / "99"
    link_dir.mkdir()
    (link_dir / f"99aa{disk.SUFFIX}").symlink_to(tmp_path / KEY[:2] / f"{KEY}{disk.SUFFIX}")
    assert not server.contains("99aa")  # a link placed in the root is never followed


def test_a_named_pipe_in_an_entrys_place_is_a_miss_not_a_hang(tmp_path):
    """A FIFO where an indexed entry was: a plain open blocks until a writer comes (forever, and the
    worker with it). Opened non-blocking and required to be a regular file, it is a corrupt miss, and
    the scheduler's listing does not count it as stored."""
    store = DiskStore(tmp_path, IDENTITY, BIG)
    assert store.put(KEY, make_entry(5))
    path = store._path(KEY)
    path.unlink()
    os.mkfifo(path)
    result = []
    reader = threading.Thread(target=lambda: result.append(store.get(KEY)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive() and result == [None]
    assert store.stats.misses == {"corrupt": 1}
    store._path("ef34ab").parent.mkdir()
    os.mkfifo(store._path("ef34ab"))
    assert disk.list_keys(tmp_path) == set()


class _SmallFilesystem:
    """A filesystem of `limit` bytes under the store's root: a temp file that would pass it fails with
    ENOSPC, as a full disk does (the store's own budget is larger: other files filled the disk)."""

    def __init__(self, store: DiskStore, limit: int) -> None:
        self.store, self.limit, self.write = store, limit, store._write_temp
        store._write_temp = self

    def __call__(self, path: Path, data: bytes) -> Path:
        used = sum(p.stat().st_size for p in self.store.root.glob("??/*"))
        if used + len(data) > self.limit:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.write(path, data)


def test_a_full_filesystem_evicts_to_make_room_instead_of_refusing_every_put(tmp_path):
    """The filesystem fills before the byte budget does: a put evicts least recently used unpinned
    entries (never the key's own old file, still served until the rename) and writes again; before, every
    put failed from then on while evictable entries sat on the disk."""
    size = len(entry_format.encode_entry(make_entry(5), IDENTITY))
    store = DiskStore(tmp_path, IDENTITY, BIG)
    _SmallFilesystem(store, 4 * size)
    keys = [f"ab{i:04d}" for i in range(10)]
    with store.pinned([keys[0]]):
        assert all(store.put(key, make_entry(5, seed=i)) for i, key in enumerate(keys))
        assert store.contains(keys[0]) and store.get(keys[0]) is not None  # pinned: kept
    assert keys[-1] in store.keys() and store.stats.evictions >= 6 and store.stats.put_failures == 0
    assert sum(p.stat().st_size for p in tmp_path.glob("??/*")) <= 4 * size


def test_a_full_filesystem_of_pinned_entries_fails_the_put(tmp_path):
    size = len(entry_format.encode_entry(make_entry(5), IDENTITY))
    store = DiskStore(tmp_path, IDENTITY, BIG)
    _SmallFilesystem(store, 2 * size)
    with store.pinned(["ab0000", "ab0001"]):
        assert store.put("ab0000", make_entry(5)) and store.put("ab0001", make_entry(5))
        assert not store.put("ab0002", make_entry(5))
    assert store.stats.put_failures == 1 and sorted(store.keys()) == ["ab0000", "ab0001"]

"""Local-disk tier (the embedded default): one checksummed safetensors file per entry, written atomically.

Imports torch, safetensors and `cachefuse.store.base`. Layout (one file per key):

    root/<key[:2]>/<key>.safetensors      tensors k.{layer} [num_tokens, num_kv_heads, head_dim],
                                                  v.{layer} [num_tokens, num_kv_heads, head_dim_v]
    __metadata__: format=cachefuse-kv, format_version=1, model_fingerprint, num_layers, dtype,
                  num_tokens, checksum.k.{i} / checksum.v.{i} (zlib.crc32 of the raw bytes, 8 hex
                  digits), meta.<name> (ChunkKV.meta)

Files are owner-only (0600, directories 0700), and symbolic links inside the root are never followed:
an entry file or shard directory that is a link is not indexed, read, stamped, replaced or deleted.

A put writes `.tmp-*` next to the target, fsyncs it, then `os.replace`s it, so a reader or a restart
sees the whole old file or the whole new one, never a prefix; a crashed writer leaves only a temp
file, which a later scan deletes once it is older than STALE_TEMP_S (a younger one may be another
process's write in flight). A write the filesystem refuses as full (ENOSPC) evicts least recently used
unpinned entries and is tried once more. Entry files are opened without following links or blocking
and must be regular files (a named pipe would block a plain open forever). The index (key -> file
bytes, LRU order) is built by one directory scan at construction, so `contains` does no I/O. LRU order
survives a restart: every write and every hit stamps the file's mtime from a strictly increasing clock,
and the scan orders by it. An entry another process writes later (precompute beside a server) is
indexed the first time `contains` asks for its key (one stat of a key the index lacks).

Reads are plain reads into tensors that own their memory, each verified (crc32) in that memory: the
file is never memory-mapped, so a served tensor cannot change under its reader when the file is
rewritten in place, a file truncated meanwhile is a "truncated" miss (not a SIGBUS), and an evicted
file's blocks are freed at once, whoever still holds its tensors (the memory tier keeps them as given).

Misses: a header for another format version, model fingerprint or dtype is "foreign_model"; another
layer count or tensor shape is "shape_mismatch" (checked, with every tensor's size, before any tensor
byte is read); a bad checksum, a missing tensor, an unparsable file or one larger than the tier's
whole budget is "corrupt"; a file shorter than its header says is "truncated". Each of these drops the
entry from the index and deletes its file. "io_error" keeps both (the medium may recover); a file that
vanished is "absent" and leaves the index.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import stat
import struct
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import safetensors.torch
import torch

from cachefuse.errors import ConfigError
from cachefuse.store import base
from cachefuse.store.base import ChunkKV, StoreIdentity

logger = logging.getLogger(__name__)

FORMAT = "cachefuse-kv"
FORMAT_VERSION = "1"
SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"
STALE_TEMP_S = 600
"""A temp file older than this at start-up is a dead writer's and is deleted; a younger one may be a
write in flight of another process sharing the directory (`cachefuse precompute` beside a server),
which a restart must not break."""
MAX_NUM_TOKENS = 1 << 20
"""More tokens than any chunk has: a header claiming more is not one of ours."""
_Layers = tuple[list[torch.Tensor], list[torch.Tensor], dict[str, str]]  # k_nope per layer, v per layer, meta


class _Miss(Exception):
    """Raised inside the read path; turned into a counted miss by DiskStore._load."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail


def checksum(t: torch.Tensor) -> str:
    """zlib.crc32 of the tensor's raw bytes (row-major), as 8 hex digits."""
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # [numel * element_size]
    return f"{zlib.crc32(raw.numpy()):08x}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_entry(entry: ChunkKV, identity: StoreIdentity) -> bytes:
    """The complete safetensors file for `entry` (header with checksums and meta, then the data)."""
    metadata = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "model_fingerprint": identity.model_fingerprint,
        "num_layers": str(identity.num_layers), "dtype": _dtype_name(identity.dtype),
        "num_tokens": str(entry.num_tokens),
    }
    tensors: dict[str, torch.Tensor] = {}
    spans: list[tuple[int, int]] = []  # byte ranges already taken
    for layer, (k_nope, v) in enumerate(zip(entry.k_nope, entry.v, strict=True)):
        for name, t in ((f"k.{layer}", k_nope), (f"v.{layer}", v)):
            t = t.detach().cpu().contiguous()  # safetensors reads through data_ptr(): host memory only
            if any(t.data_ptr() < end and start < t.data_ptr() + t.nbytes for start, end in spans):
                t = t.clone()  # safetensors refuses aliased tensors (e.g. one tensor given for every layer)
            spans.append((t.data_ptr(), t.data_ptr() + t.nbytes))
            tensors[name] = t
            metadata[f"checksum.{name}"] = checksum(t)
    metadata.update({f"meta.{name}": value for name, value in entry.meta.items()})
    return safetensors.torch.save(tensors, metadata=metadata)


def _check_header(metadata: dict[str, str], identity: StoreIdentity) -> int:
    """Validate the header against `identity`; returns num_tokens or raises _Miss."""
    found = (metadata.get("format"), metadata.get("format_version"))
    if found != (FORMAT, FORMAT_VERSION):
        raise _Miss(base.MISS_FOREIGN_MODEL, f"format {found}, expected {(FORMAT, FORMAT_VERSION)}")
    if metadata.get("model_fingerprint") != identity.model_fingerprint:
        raise _Miss(base.MISS_FOREIGN_MODEL, f"model_fingerprint {metadata.get('model_fingerprint')!r}")
    if metadata.get("dtype") != _dtype_name(identity.dtype):
        raise _Miss(base.MISS_FOREIGN_MODEL, f"dtype {metadata.get('dtype')!r}, expected {identity.dtype}")
    try:
        num_layers, num_tokens = int(metadata["num_layers"]), int(metadata["num_tokens"])
    except (KeyError, ValueError) as exc:
        raise _Miss(base.MISS_CORRUPT, f"bad num_layers/num_tokens: {exc!r}") from None
    if num_layers != identity.num_layers:
        raise _Miss(base.MISS_SHAPE_MISMATCH, f"num_layers {num_layers}, expected {identity.num_layers}")
    return num_tokens


def _read_tensor(f, name: str, metadata: dict[str, str], num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """Load tensor `name` from the open file `f` and verify its shape, dtype and checksum."""
    if name not in f.keys():
        raise _Miss(base.MISS_CORRUPT, f"{name} missing")
    t = f.get_tensor(name)
    if t.dtype != dtype or t.dim() != 3 or t.shape[0] != num_tokens:
        raise _Miss(base.MISS_SHAPE_MISMATCH, f"{name}: {tuple(t.shape)} {t.dtype}, num_tokens {num_tokens}")
    checksum_as_read = getattr(f, "checksum_as_read", None)  # a disk file's, taken while reading into `t`
    if (checksum_as_read(name) if checksum_as_read else checksum(t)) != metadata.get(f"checksum.{name}"):
        raise _Miss(base.MISS_CORRUPT, f"{name}: checksum mismatch")
    return t


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_TORCH_DTYPES = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class _TensorSpec:
    """One tensor's entry in a safetensors header, its offsets made absolute in the file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _open_entry(path: Path) -> BinaryIO:
    """The entry file, unbuffered: every tensor is one read straight into its own buffer.

    Opened without following a link and without blocking, then required to be a regular file: a named
    pipe put where an entry was would block a plain open (and the worker with it) forever."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _Miss(base.MISS_CORRUPT, "not a regular file")
        os.set_blocking(fd, True)  # a FUSE or network filesystem may honour O_NONBLOCK on reads (EAGAIN)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


_READ_CHUNK_BYTES = 256 * 1024
"""Bytes per read: small enough that the checksum of a chunk runs over it while it is still in cache
(measured: 100 MB read then checksummed takes ~1.5x as long as in 256 KiB read-checksum steps)."""


def _read_exactly(fh: BinaryIO, offset: int, buffer: memoryview) -> int:
    """Fill `buffer` from `fh` at `offset`; returns zlib.crc32 of what was read. A file that ends first is
    "truncated" (cut since its header was read)."""
    fh.seek(offset)
    done, crc = 0, 0
    while done < len(buffer):
        chunk = buffer[done:done + _READ_CHUNK_BYTES]
        got = fh.readinto(chunk)
        if not got:
            raise _Miss(base.MISS_TRUNCATED, f"file ends at {offset + done}, {len(buffer) - done} bytes short")
        crc = zlib.crc32(chunk[:got], crc)
        done += got
    return crc


def _tensor_spec(name: str, spec: object, data_start: int) -> _TensorSpec:
    """`spec` (one tensor's header entry) checked for types and made absolute; "corrupt" if malformed."""
    try:
        dtype, shape, (begin, end) = spec["dtype"], spec["shape"], spec["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise _Miss(base.MISS_CORRUPT, f"{name}: malformed header entry") from None
    numbers = [*shape, begin, end] if isinstance(shape, list) else [None]
    if not isinstance(dtype, str) or not all(type(n) is int and n >= 0 for n in numbers) or begin > end:
        raise _Miss(base.MISS_CORRUPT, f"{name}: dtype {dtype!r}, shape {shape!r}, offsets {[begin, end]!r}")
    return _TensorSpec(dtype, tuple(shape), data_start + begin, data_start + end)


def _read_header(fh: BinaryIO, size: int) -> tuple[dict[str, str], dict[str, _TensorSpec]]:
    """The safetensors header of the open file of `size` bytes: (metadata, tensor name -> spec).

    As strict as safetensors' own parser about the file's length: shorter than the header says is
    "truncated", longer is "corrupt" (entries are written whole)."""
    prefix = fh.read(8)
    if len(prefix) < 8:
        raise _Miss(base.MISS_TRUNCATED, f"{len(prefix)} bytes: no header length")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > base.MAX_ENTRY_HEADER_BYTES:
        raise _Miss(base.MISS_CORRUPT, f"header length {header_len} over {base.MAX_ENTRY_HEADER_BYTES}")
    if size < 8 + header_len:
        raise _Miss(base.MISS_TRUNCATED, f"{size} bytes, header says {8 + header_len} before any tensor")
    raw = bytearray(header_len)
    _read_exactly(fh, 8, memoryview(raw))
    try:
        header = json.loads(raw)
    except ValueError as exc:  # JSON or UTF-8
        raise _Miss(base.MISS_CORRUPT, f"header: {exc}") from None
    metadata = header.pop("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _Miss(base.MISS_CORRUPT, "header is not a safetensors header with string metadata")
    specs = {name: _tensor_spec(name, spec, 8 + header_len) for name, spec in header.items()}
    data_end = max((spec.end for spec in specs.values()), default=8 + header_len)
    if data_end != size:
        reason = base.MISS_TRUNCATED if data_end > size else base.MISS_CORRUPT
        raise _Miss(reason, f"{size} bytes, header says {data_end}")
    return metadata, specs


class _EntryFile:
    """An open entry file for `_read_tensor`: its header (`keys`), `get_tensor`, a plain read of one tensor
    into a new tensor that owns its memory, and `checksum_as_read`, that tensor's checksum.

    Not memory-mapped as safetensors' `safe_open` would: a mapped tensor stays the file's pages after its
    checksum passed (rewritten in place, the served K/V change; truncated, a read of it is a SIGBUS), and
    keeps an evicted file's blocks allocated as long as anyone holds it. Reading into the tensor's own
    buffer and checksumming each chunk as it lands copies once (a mapping plus a clone would copy too,
    and then read the bytes a third time).
    """

    def __init__(self, fh: BinaryIO, size: int) -> None:
        self._fh = fh
        self.metadata, self.specs = _read_header(fh, size)
        self._checksums: dict[str, str] = {}

    def keys(self) -> list[str]:
        return list(self.specs)

    def get_tensor(self, name: str) -> torch.Tensor:
        spec = self.specs[name]  # its dtype and byte count checked by _check_sizes
        tensor = torch.empty(spec.shape, dtype=_TORCH_DTYPES[spec.dtype])
        raw = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # [numel * element_size], the tensor's own
        self._checksums[name] = f"{_read_exactly(self._fh, spec.begin, raw):08x}"
        return tensor

    def checksum_as_read(self, name: str) -> str:
        """`checksum` of the tensor `get_tensor(name)` returned, taken chunk by chunk as it was read into
        the tensor's own memory (the same bytes; no second pass over them)."""
        return self._checksums[name]


def _check_file_size(size: int, capacity_bytes: int) -> None:
    """Before any byte is read: a file larger than the tier's whole budget is not an entry this tier wrote
    (a put that big is refused; the scan evicts such a file), so a crafted header cannot make a read
    allocate more than the budget, however large the file claims to be.

    The bound is the file's apparent size (st_size), not the blocks it holds (st_blocks), which once
    stood in for it to refuse sparse files: st_blocks says nothing reliable about an intact file. ZFS
    reports st_blocks=1 for a file written and fsynced moments ago until its transaction group commits
    (a few seconds), and with compression or after a `cp --sparse` copy st_blocks * 512 stays below
    st_size for good: intact entries were deleted as "corrupt". A sparse file within the budget is read
    as the zeros it holds, and its checksums then fail.
    """
    if size > capacity_bytes:
        raise _Miss(base.MISS_CORRUPT, f"{size} bytes, more than the tier's whole budget ({capacity_bytes})")


def _check_sizes(f: _EntryFile, names: list[str], num_tokens: int, dtype: torch.dtype) -> None:
    """Before any tensor byte is read: every tensor is there, of the header's token count, the store's
    dtype, and as many bytes as its shape needs (the file holds them all: `_read_header` checked)."""
    if not 0 < num_tokens <= MAX_NUM_TOKENS:
        raise _Miss(base.MISS_CORRUPT, f"num_tokens {num_tokens} outside 1..{MAX_NUM_TOKENS}")
    expected_dtype = _SAFETENSORS_DTYPES.get(dtype)
    for name in names:
        spec = f.specs.get(name)
        if spec is None:
            raise _Miss(base.MISS_CORRUPT, f"{name} missing")
        if len(spec.shape) != 3 or spec.shape[0] != num_tokens or spec.dtype != expected_dtype:
            raise _Miss(base.MISS_SHAPE_MISMATCH, f"{name}: {spec.shape} {spec.dtype}, num_tokens {num_tokens}")
        if spec.end - spec.begin != math.prod(spec.shape) * dtype.itemsize:
            raise _Miss(base.MISS_CORRUPT, f"{name}: {spec.end - spec.begin} bytes for shape {spec.shape}")


def _fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (else a power loss can undo it); best effort."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class DiskStore(base.PinnedKeysMixin, base.LayerReadsMixin, base.EvictionPlanMixin):
    """Local-disk tier (see the module docstring for layout, atomicity and miss reasons).

    `name` ("disk") labels the tier in measured load figures.

    Args:
        root: directory of the store; created if missing. An unusable root is logged and every put
            then returns False (the engine keeps running without this tier).
        identity: what every entry must match.
        capacity_bytes: budget of file bytes (header included) over all entries.
        _before_rename: test hook, called with the temp file's path after it is fully written and
            fsynced, just before the rename.
    """

    name = "disk"

    def __init__(self, root: str | Path, identity: StoreIdentity, capacity_bytes: int, *,
                 _before_rename: Callable[[Path], None] | None = None) -> None:
        if capacity_bytes < 0:
            raise ConfigError(f"disk capacity_bytes={capacity_bytes!r}, expected >= 0")
        self.root = Path(root)
        self.identity = identity
        self.capacity_bytes = capacity_bytes
        self.stats = base.StoreStats()
        self._before_rename = _before_rename
        self._sizes: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._pins = base.PinTable()
        self._lock = threading.RLock()
        self._last_stamp_ns = 0
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            logger.warning("disk store root %s is unusable (%s): every put will fail", self.root, exc)
        self._scan()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def put(self, key: str, entry: ChunkKV) -> bool:
        """Write `entry` atomically, evicting least recently used unpinned entries as needed.

        Returns:
            False (logged, counted) if the entry is foreign, does not fit even after evicting every
            unpinned entry, or cannot be written; the previous file of `key`, if any, is then kept.
        """
        base.check_key(key)
        mismatch = base.entry_mismatch(entry, self.identity)
        if mismatch is not None:
            return self._fail(key, "foreign entry ({}: {})".format(*mismatch))
        try:
            data = encode_entry(entry, self.identity)
        except Exception as exc:  # whatever safetensors refuses must fail this put, not the caller
            return self._fail(key, f"cannot serialize: {exc!r}")
        path = self._path(key)
        try:  # written and fsynced outside the lock: readers of other keys never wait on this disk write
            tmp = self._write_temp(path, data)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or not self._free_disk_space(key, len(data)):
                return self._fail(key, f"write failed: {exc!r}")
            try:  # the filesystem filled before the budget did: room was made, one more try
                tmp = self._write_temp(path, data)
            except OSError as exc_again:
                return self._fail(key, f"write failed on a full filesystem: {exc_again!r}")
        with self._lock:
            victims = base.plan_eviction(self._sizes, self._pins, self.capacity_bytes, key, len(data))
            try:
                if victims is None:
                    return self._fail(key, f"{len(data)} bytes do not fit in {self.capacity_bytes} (rest pinned)")
                if self._before_rename is not None:
                    self._before_rename(tmp)
                os.replace(tmp, path)
            except OSError as exc:
                return self._fail(key, f"write failed: {exc!r}")
            finally:
                with contextlib.suppress(OSError):
                    tmp.unlink()  # gone after the rename; else never left behind
            for victim in victims:
                self._unlink(victim)
                self.stats.evictions += 1
                logger.debug("disk evicted %s", victim)
            self._sizes[key] = len(data)
            self._sizes.move_to_end(key)
            self.stats.puts += 1
            self.stats.bytes_written += len(data)
        _fsync_dir(path.parent)
        return True

    def _free_disk_space(self, key: str, nbytes: int) -> bool:
        """Evicts least recently used unpinned entries (never `key`'s own, still served until the rename)
        holding at least `nbytes`, for a write the filesystem refused as full (ENOSPC: other files, or
        several writers' temp files, filled it before this store's budget did). False if they cannot."""
        with self._lock:
            others = OrderedDict((k, size) for k, size in self._sizes.items() if k != key)
            victims = base.plan_eviction(others, self._pins, max(0, sum(others.values()) - nbytes), "", 0)
            if not victims:
                return False
            for victim in victims:
                self._unlink(victim)
                self.stats.evictions += 1
        logger.warning("disk store %s: filesystem full; evicted %d entries to write %s", self.root, len(victims),
                       key)
        return True

    def contains(self, key: str) -> bool:
        """Whether `key` has an entry: in the index, or written since the scan by another process sharing
        the directory (`cachefuse precompute` beside a server, another engine), which is then indexed."""
        return key in self._sizes or self._adopt(key)

    def _adopt(self, key: str) -> bool:
        """Indexes an entry file another process wrote after this store's scan (one stat: the key was not
        in the index). Its writer renamed it into place whole; its bytes are verified when read. It joins
        the budget as the most recently used entry, evicting as a put would; one that does not fit is
        left alone and not indexed."""
        if not base.is_valid_key(key):
            return False
        path = self._path(key)
        try:
            st = path.lstat()
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or _escapes_root(path):
            return False
        with self._lock:
            if key in self._sizes:
                return True
            victims = base.plan_eviction(self._sizes, self._pins, self.capacity_bytes, key, st.st_size)
            if victims is None:
                return False
            for victim in victims:
                self._unlink(victim)
                self.stats.evictions += 1
            self._sizes[key] = st.st_size
        logger.debug("disk store indexed %s, written by another process", key)
        return True

    def remove(self, key: str) -> None:
        """Drop `key` and delete its file if present (pinned or not: pins only guard against eviction)."""
        base.check_key(key)
        with self._lock:
            self._unlink(key)

    def keys(self) -> list[str]:
        """Indexed keys, least recently used first."""
        with self._lock:
            return list(self._sizes)

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{SUFFIX}"

    def _load(self, key: str, layers: range) -> _Layers | None:
        """Read and verify `layers` of `key`; None on a miss, with bad entries dropped."""
        with self._lock:
            if key not in self._sizes:
                return self._miss(key, base.MISS_ABSENT, "not indexed", inode=None)
            self._sizes.move_to_end(key)
        path = self._path(key)
        if _escapes_root(path):  # placed by someone else after the scan: never followed, never deleted
            with self._lock:
                self._sizes.pop(key, None)
            self.stats.record_miss(base.MISS_CORRUPT)
            logger.warning("disk miss %s: %s is a symbolic link (or in one): not followed", key, path)
            return None
        inode = None
        try:
            inode = path.stat().st_ino
            k_nope, v, meta = self._read_file(path, layers)
        except _Miss as miss:
            return self._miss(key, miss.reason, miss.detail, inode)
        except FileNotFoundError:
            return self._miss(key, base.MISS_ABSENT, "file vanished", inode)
        except OSError as exc:
            return self._miss(key, base.MISS_IO_ERROR, repr(exc), inode)
        except Exception as exc:  # whatever else bad bytes provoke must stay a miss
            return self._miss(key, base.MISS_CORRUPT, repr(exc), inode)
        self._stamp(path)
        self.stats.hits += 1
        self.stats.bytes_read += sum(t.nbytes for t in (*k_nope, *v))
        return k_nope, v, meta

    def _read_file(self, path: Path, layers: range) -> _Layers:
        dtype = self.identity.dtype
        k_nope, v = [], []
        with _open_entry(path) as fh:
            size = os.fstat(fh.fileno()).st_size
            _check_file_size(size, self.capacity_bytes)
            f = _EntryFile(fh, size)
            metadata = f.metadata
            num_tokens = _check_header(metadata, self.identity)
            _check_sizes(f, [f"{kv}.{layer}" for layer in layers for kv in "kv"], num_tokens, dtype)
            for layer in layers:
                k_nope.append(_read_tensor(f, f"k.{layer}", metadata, num_tokens, dtype))
                v.append(_read_tensor(f, f"v.{layer}", metadata, num_tokens, dtype))
                if k_nope[-1].shape[1] != v[-1].shape[1]:
                    raise _Miss(base.MISS_SHAPE_MISMATCH, f"layer {layer}: K and V differ in num_kv_heads")
        meta = {name[len("meta."):]: value for name, value in metadata.items() if name.startswith("meta.")}
        return k_nope, v, meta

    def _miss(self, key: str, reason: str, detail: str, inode: int | None) -> None:
        self.stats.record_miss(reason)
        if reason == base.MISS_ABSENT:
            logger.debug("disk miss %s: absent (%s)", key, detail)
        else:
            logger.warning("disk miss %s: %s (%s)", key, reason, detail)
        if reason == base.MISS_IO_ERROR:
            return None
        with self._lock:
            if reason != base.MISS_ABSENT:
                path = self._path(key)
                try:
                    if path.stat().st_ino != inode:
                        return None  # a put replaced the bad file meanwhile: keep the new one
                    path.unlink()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    logger.warning("disk store could not delete bad entry %s: %r", path, exc)
            self._sizes.pop(key, None)
        return None

    def _fail(self, key: str, reason: str) -> bool:
        self.stats.put_failures += 1
        logger.warning("disk put %s failed: %s", key, reason)
        return False

    def _write_temp(self, path: Path, data: bytes) -> Path:
        """`data` in a new owner-only temp file beside `path`, fsynced and stamped; the caller renames it."""
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if os.path.islink(path.parent):
            raise PermissionError(f"{path.parent} is a symbolic link: not followed out of the store's root")
        fd, tmp_name = tempfile.mkstemp(prefix=TMP_PREFIX, dir=path.parent)  # mode 0600: owner only
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            stamp = self._next_stamp_ns()
            os.utime(tmp, ns=(stamp, stamp))
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return tmp

    def _next_stamp_ns(self) -> int:
        # Explicit, strictly increasing stamps: the kernel's own mtimes are tick-grained, so files
        # touched within one tick would tie and the LRU order after a restart would be lost.
        with self._lock:
            self._last_stamp_ns = max(time.time_ns(), self._last_stamp_ns + 1)
            return self._last_stamp_ns

    def _stamp(self, path: Path) -> None:
        stamp = self._next_stamp_ns()
        try:
            os.utime(path, ns=(stamp, stamp), follow_symlinks=False)
        except OSError as exc:  # the hit stands; only the LRU order after a restart suffers
            logger.debug("disk store could not stamp %s: %r", path, exc)

    def _unlink(self, key: str) -> None:
        """Drop `key` from the index and delete its file (caller holds the lock)."""
        if self._sizes.pop(key, None) is None:
            return
        if os.path.islink(self._path(key).parent):
            return  # unlinking through it would delete a file outside the root
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("disk store could not delete %s: %r", self._path(key), exc)

    def _scan(self) -> None:
        """Build the index from the files under root; delete temp files; enforce the capacity."""
        found: list[tuple[int, str, int]] = []  # (mtime_ns, key, file bytes)
        for path in self.root.glob("??/*"):  # unreadable or missing directories yield nothing
            key = path.name.removesuffix(SUFFIX)
            if _escapes_root(path):
                logger.warning("disk store skips %s: a symbolic link (or in one), not followed", path)
                continue
            try:
                if path.name.startswith(TMP_PREFIX):  # never an entry; a dead writer's, once old enough
                    if time.time() - path.lstat().st_mtime > STALE_TEMP_S:
                        logger.info("disk store deleting leftover temp file %s", path)
                        path.unlink()
                elif key != path.name and key[:2] == path.parent.name and base.is_valid_key(key):
                    st = path.lstat()
                    if stat.S_ISREG(st.st_mode):
                        found.append((st.st_mtime_ns, key, st.st_size))
            except OSError as exc:
                logger.warning("disk store skips %s: %r", path, exc)
        for stamp, key, size in sorted(found):
            self._sizes[key] = size
            self._last_stamp_ns = max(self._last_stamp_ns, stamp)
        victims = base.plan_eviction(self._sizes, self._pins, self.capacity_bytes, "", 0) or []
        for victim in victims:
            self._unlink(victim)
            self.stats.evictions += 1
        logger.info("disk store %s: %d entries, %d bytes (%d evicted to fit %d)",
                    self.root, len(self._sizes), self.nbytes, len(victims), self.capacity_bytes)


def list_keys(root: str | Path) -> set[str]:
    """Keys of the entries under `root`, read-only (no cleanup, no header reads).

    For processes that only look up (the vLLM scheduler's index); the DiskStore that writes is
    the one owner of the directory.
    """
    root = Path(root)
    if not root.is_dir():
        return set()
    keys = set()
    for path in root.glob(f"*/*{SUFFIX}"):
        key = path.name.removesuffix(SUFFIX)
        if not path.name.startswith(TMP_PREFIX) and base.is_valid_key(key) and not _escapes_root(path):
            with contextlib.suppress(OSError):
                if stat.S_ISREG(path.lstat().st_mode):  # not a pipe or a directory put in an entry's place
                    keys.add(key)
    return keys


def _escapes_root(path: Path) -> bool:
    """The entry file or its shard directory is a symbolic link: following it would read, stamp, replace
    or delete a file outside the store's root. (The root itself may be a link: the operator chose it.)"""
    return os.path.islink(path) or os.path.islink(path.parent)

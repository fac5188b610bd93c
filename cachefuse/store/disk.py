"""Local-disk tier (the embedded default): one checksummed safetensors file per entry, written atomically.

Imports `cachefuse.store.{base, entry_format}`: this module owns the directory (index, LRU order,
capacity, eviction, atomic writes, the scan), entry_format.py the bytes of one entry (encoding, and
the verified read described below). Never imports `cachefuse.metadata`. Layout (one file per key):

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
import logging
import os
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from cachefuse.errors import ConfigError
from cachefuse.store import base
from cachefuse.store.base import ChunkKV, StoreIdentity
from cachefuse.store.entry_format import EntryMiss, Layers, encode_entry, read_entry

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"
STALE_TEMP_S = 600
"""A temp file older than this at start-up is a dead writer's and is deleted; a younger one may be a
write in flight of another process sharing the directory (`cachefuse precompute` beside a server),
which a restart must not break."""


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

    def _load(self, key: str, layers: range) -> Layers | None:
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
            k_nope, v, meta = read_entry(path, layers, self.identity, self.capacity_bytes)
        except EntryMiss as miss:
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

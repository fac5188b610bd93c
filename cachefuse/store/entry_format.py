"""The K/V entry format the disk and Redis tiers share: encoding, header and tensor checks, and the
reading of one entry file, each tensor read into memory it owns and verified there.

Imports torch, safetensors, `cachefuse.chunks` (dtype_name) and `cachefuse.store.base`; never `cachefuse.metadata` (the K/V bytes know
nothing of variants), never the tiers that use it (disk.py, redis.py). An entry file is a safetensors
file; its layout, and which failure is which miss reason, are in disk.py's docstring. `EntryMiss`
carries a miss reason out of these checks; each tier turns it into a counted miss.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import safetensors.torch
import torch

from cachefuse.chunks import dtype_name
from cachefuse.store import base
from cachefuse.store.base import ChunkKV, StoreIdentity

FORMAT = "cachefuse-kv"
FORMAT_VERSION = "1"
MAX_NUM_TOKENS = 1 << 20
"""More tokens than any chunk has: a header claiming more is not one of ours."""
Layers = tuple[list[torch.Tensor], list[torch.Tensor], dict[str, str]]  # k_nope per layer, v per layer, meta


class EntryMiss(Exception):
    """A miss found while checking an entry: its reason (base.MISS_*) and what was found."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail


def checksum(t: torch.Tensor) -> str:
    """zlib.crc32 of the tensor's raw bytes (row-major), as 8 hex digits."""
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # [numel * element_size]
    return f"{zlib.crc32(raw.numpy()):08x}"


def encode_entry(entry: ChunkKV, identity: StoreIdentity) -> bytes:
    """The complete safetensors file for `entry` (header with checksums and meta, then the data)."""
    metadata = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "model_fingerprint": identity.model_fingerprint,
        "num_layers": str(identity.num_layers), "dtype": dtype_name(identity.dtype),
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


def check_header(metadata: dict[str, str], identity: StoreIdentity) -> int:
    """Validate the header against `identity`; returns num_tokens or raises EntryMiss."""
    found = (metadata.get("format"), metadata.get("format_version"))
    if found != (FORMAT, FORMAT_VERSION):
        raise EntryMiss(base.MISS_FOREIGN_MODEL, f"format {found}, expected {(FORMAT, FORMAT_VERSION)}")
    if metadata.get("model_fingerprint") != identity.model_fingerprint:
        raise EntryMiss(base.MISS_FOREIGN_MODEL, f"model_fingerprint {metadata.get('model_fingerprint')!r}")
    if metadata.get("dtype") != dtype_name(identity.dtype):
        raise EntryMiss(base.MISS_FOREIGN_MODEL, f"dtype {metadata.get('dtype')!r}, expected {identity.dtype}")
    try:
        num_layers, num_tokens = int(metadata["num_layers"]), int(metadata["num_tokens"])
    except (KeyError, ValueError) as exc:
        raise EntryMiss(base.MISS_CORRUPT, f"bad num_layers/num_tokens: {exc!r}") from None
    if num_layers != identity.num_layers:
        raise EntryMiss(base.MISS_SHAPE_MISMATCH, f"num_layers {num_layers}, expected {identity.num_layers}")
    return num_tokens


def read_tensor(f, name: str, metadata: dict[str, str], num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """Load tensor `name` from the open file `f` and verify its shape, dtype and checksum."""
    if name not in f.keys():
        raise EntryMiss(base.MISS_CORRUPT, f"{name} missing")
    t = f.get_tensor(name)
    if t.dtype != dtype or t.dim() != 3 or t.shape[0] != num_tokens:
        raise EntryMiss(base.MISS_SHAPE_MISMATCH, f"{name}: {tuple(t.shape)} {t.dtype}, num_tokens {num_tokens}")
    checksum_as_read = getattr(f, "checksum_as_read", None)  # a disk file's, taken while reading into `t`
    if (checksum_as_read(name) if checksum_as_read else checksum(t)) != metadata.get(f"checksum.{name}"):
        raise EntryMiss(base.MISS_CORRUPT, f"{name}: checksum mismatch")
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
            raise EntryMiss(base.MISS_CORRUPT, "not a regular file")
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
            raise EntryMiss(base.MISS_TRUNCATED, f"file ends at {offset + done}, {len(buffer) - done} bytes short")
        crc = zlib.crc32(chunk[:got], crc)
        done += got
    return crc


def _tensor_spec(name: str, spec: object, data_start: int) -> _TensorSpec:
    """`spec` (one tensor's header entry) checked for types and made absolute; "corrupt" if malformed."""
    try:
        dtype, shape, (begin, end) = spec["dtype"], spec["shape"], spec["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise EntryMiss(base.MISS_CORRUPT, f"{name}: malformed header entry") from None
    numbers = [*shape, begin, end] if isinstance(shape, list) else [None]
    if not isinstance(dtype, str) or not all(type(n) is int and n >= 0 for n in numbers) or begin > end:
        raise EntryMiss(base.MISS_CORRUPT, f"{name}: dtype {dtype!r}, shape {shape!r}, offsets {[begin, end]!r}")
    return _TensorSpec(dtype, tuple(shape), data_start + begin, data_start + end)


def _read_header(fh: BinaryIO, size: int) -> tuple[dict[str, str], dict[str, _TensorSpec]]:
    """The safetensors header of the open file of `size` bytes: (metadata, tensor name -> spec).

    As strict as safetensors' own parser about the file's length: shorter than the header says is
    "truncated", longer is "corrupt" (entries are written whole)."""
    prefix = fh.read(8)
    if len(prefix) < 8:
        raise EntryMiss(base.MISS_TRUNCATED, f"{len(prefix)} bytes: no header length")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > base.MAX_ENTRY_HEADER_BYTES:
        raise EntryMiss(base.MISS_CORRUPT, f"header length {header_len} over {base.MAX_ENTRY_HEADER_BYTES}")
    if size < 8 + header_len:
        raise EntryMiss(base.MISS_TRUNCATED, f"{size} bytes, header says {8 + header_len} before any tensor")
    raw = bytearray(header_len)
    _read_exactly(fh, 8, memoryview(raw))
    try:
        header = json.loads(raw)
    except ValueError as exc:  # JSON or UTF-8
        raise EntryMiss(base.MISS_CORRUPT, f"header: {exc}") from None
    metadata = header.pop("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise EntryMiss(base.MISS_CORRUPT, "header is not a safetensors header with string metadata")
    specs = {name: _tensor_spec(name, spec, 8 + header_len) for name, spec in header.items()}
    data_end = max((spec.end for spec in specs.values()), default=8 + header_len)
    if data_end != size:
        reason = base.MISS_TRUNCATED if data_end > size else base.MISS_CORRUPT
        raise EntryMiss(reason, f"{size} bytes, header says {data_end}")
    return metadata, specs


class _EntryFile:
    """An open entry file for `read_tensor`: its header (`keys`), `get_tensor`, a plain read of one tensor
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
        raise EntryMiss(base.MISS_CORRUPT, f"{size} bytes, more than the tier's whole budget ({capacity_bytes})")


def _check_sizes(f: _EntryFile, names: list[str], num_tokens: int, dtype: torch.dtype) -> None:
    """Before any tensor byte is read: every tensor is there, of the header's token count, the store's
    dtype, and as many bytes as its shape needs (the file holds them all: `_read_header` checked)."""
    if not 0 < num_tokens <= MAX_NUM_TOKENS:
        raise EntryMiss(base.MISS_CORRUPT, f"num_tokens {num_tokens} outside 1..{MAX_NUM_TOKENS}")
    expected_dtype = _SAFETENSORS_DTYPES.get(dtype)
    for name in names:
        spec = f.specs.get(name)
        if spec is None:
            raise EntryMiss(base.MISS_CORRUPT, f"{name} missing")
        if len(spec.shape) != 3 or spec.shape[0] != num_tokens or spec.dtype != expected_dtype:
            raise EntryMiss(base.MISS_SHAPE_MISMATCH, f"{name}: {spec.shape} {spec.dtype}, num_tokens {num_tokens}")
        if spec.end - spec.begin != math.prod(spec.shape) * dtype.itemsize:
            raise EntryMiss(base.MISS_CORRUPT, f"{name}: {spec.end - spec.begin} bytes for shape {spec.shape}")



def read_entry(path: Path, layers: range, identity: StoreIdentity, capacity_bytes: int) -> Layers:
    """Read and verify `layers` of the entry file at `path`; raises EntryMiss (or OSError) on a miss.

    Args:
        path: the entry file; a link or anything but a regular file is refused.
        layers: the layers to read.
        identity: what the entry must match (format, fingerprint, dtype, layer count).
        capacity_bytes: the tier's whole budget; a larger file is "corrupt" before any byte is read.

    Returns:
        (k_nope per layer [num_tokens, num_kv_heads, head_dim], v per layer, the entry's meta).
    """
    dtype = identity.dtype
    k_nope, v = [], []
    with _open_entry(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        _check_file_size(size, capacity_bytes)
        f = _EntryFile(fh, size)
        metadata = f.metadata
        num_tokens = check_header(metadata, identity)
        _check_sizes(f, [f"{kv}.{layer}" for layer in layers for kv in "kv"], num_tokens, dtype)
        for layer in layers:
            k_nope.append(read_tensor(f, f"k.{layer}", metadata, num_tokens, dtype))
            v.append(read_tensor(f, f"v.{layer}", metadata, num_tokens, dtype))
            if k_nope[-1].shape[1] != v[-1].shape[1]:
                raise EntryMiss(base.MISS_SHAPE_MISMATCH, f"layer {layer}: K and V differ in num_kv_heads")
    meta = {name[len("meta."):]: value for name, value in metadata.items() if name.startswith("meta.")}
    return k_nope, v, meta

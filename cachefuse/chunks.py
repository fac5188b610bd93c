"""Chunk identity and request segmentation (docs/architecture.md, Definitions).

Imports only the standard library and cachefuse.errors: the scheduler process hashes and segments
requests without torch. Prompts are built from text in cachefuse.rag_prompt, which imports this module.

A chunk key depends on the chunk's token ids and the model and cache layout (`KeyContext`), never on
where the chunk sits in a prompt. A request's segments tile its prompt:

```
| system (chunk, is_system) | glue (computed) | chunk A | chunk B | question (computed) |
0                                                                                     N
```
"""

from __future__ import annotations

import hashlib
import json
import os
import reprlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachefuse.errors import ConfigError, RequestError

PARAMS_KEY = "cachefuse"
"""The key of a request's cachefuse parameters in vLLM's `kv_transfer_params`, and of its outcome in the
response's: the only spelling of it (request.py re-exports it)."""

_KEY_VERSION = b"cachefuse-chunk-key-v1"
_FINGERPRINT_VERSION = b"cachefuse-model-fingerprint-v2"  # v2: every tensor sampled
_SAMPLE_BYTES = 4096  # per sampled range of a tensor's bytes


# --------------------------------------------------------------------------- model fingerprint


def _safetensors_digest_parts(path: Path) -> list[bytes]:
    """Name, header, size and, for every tensor, the first, middle and last 4 KiB of its bytes.

    Every tensor, not the file: a fine-tune or a merged adapter changes whole weight matrices, often
    only some of them (an attention-only LoRA leaves the MLPs, the embeddings and the norms alone), so
    windows of the file alone can all fall in tensors it did not change, and two checkpoints would share
    one fingerprint, chunk keys and stored K/V. Reads about 12 KiB a tensor (~3.5 MB for Llama-3-8B).
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"model: {path} is not a safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise ConfigError(
                f"model: {path} has a header of {header_len} bytes but only {size} bytes in all"
            )
        header = f.read(header_len)
        data_start = 8 + header_len
        parts = [path.name.encode(), head, header, str(size).encode()]
        for begin, end in _tensor_ranges(path, header, size - data_start):
            for offset in sorted({begin, max(begin, (begin + end) // 2 - _SAMPLE_BYTES // 2),
                                  max(begin, end - _SAMPLE_BYTES)}):
                f.seek(data_start + offset)
                parts.append(f.read(min(_SAMPLE_BYTES, end - offset)))
    return parts


def _tensor_ranges(path: Path, header: bytes, data_len: int) -> list[tuple[int, int]]:
    """[begin, end) of every tensor's bytes in the data region, in header order; the whole region when
    the header does not parse as a safetensors header (its bytes are hashed all the same)."""
    try:
        specs = json.loads(header)
        ranges = [tuple(spec["data_offsets"]) for name, spec in specs.items() if name != "__metadata__"]
    except (ValueError, TypeError, KeyError, AttributeError):
        return [(0, data_len)]
    if not all(len(r) == 2 and all(isinstance(x, int) for x in r) and 0 <= r[0] <= r[1] <= data_len
               for r in ranges):
        raise ConfigError(f"model: {path} has tensor offsets outside its {data_len} bytes of data")
    return ranges


def resolve_model_dir(model_config: Any) -> Path:
    """The local directory of the checkpoint `model_config.model` names: a directory, or a hub id already
    in the local HF cache (never downloaded). A string that is a path (absolute, relative or ~) is not
    looked up in the hub: a mistyped directory is named as one."""
    model = str(model_config.model)
    if os.path.isdir(model):
        return Path(model)
    if model.startswith(("/", "./", "../", "~")):  # no hub id starts so
        raise ConfigError(f"model={model!r}: no such checkpoint directory; expected a local directory or a hub id "
                          "in the local cache")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=getattr(model_config, "revision", None),
                                      local_files_only=True))
    except Exception as exc:  # any hub error means: not available locally
        raise ConfigError(
            f"model={model!r}: cachefuse fingerprints the checkpoint files and found no local copy ({exc}); "
            "pass a local model directory") from exc


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """Identifies a checkpoint from its files, reading a few KiB per tensor whatever the model's size.

    Hashes config.json (canonical JSON, sorted keys) and, for each `*.safetensors` file in name
    order, its name, header, size and three 4 KiB samples of every tensor's bytes. Weights in memory
    and prompts play no part, so every process that loads the same files gets the same value.

    Args:
        model_dir: a local checkpoint directory.

    Returns:
        32 hex characters.

    Raises:
        ConfigError: config.json or the safetensors files are missing or malformed.
    """
    root = Path(model_dir)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"model: no config.json in {str(root)!r}; expected a local checkpoint directory")
    try:
        config = json.loads(config_path.read_bytes())
    except ValueError as e:
        raise ConfigError(f"model: {str(config_path)!r} is not valid JSON ({e})") from None
    weight_files = sorted(root.glob("*.safetensors"))
    if not weight_files:
        raise ConfigError(f"model: no *.safetensors files in {str(root)!r}; expected safetensors weights")
    h = hashlib.sha256(_FINGERPRINT_VERSION)
    for part in [json.dumps(config, sort_keys=True, separators=(",", ":")).encode()] + [
        p for path in weight_files for p in _safetensors_digest_parts(path)
    ]:
        h.update(struct.pack("<Q", len(part)))  # length-prefixed: no two part lists hash alike
        h.update(part)
    return h.hexdigest()[:32]


# --------------------------------------------------------------------------- chunk keys


@dataclass(frozen=True)
class KeyContext:
    """Everything besides the token ids that changes a chunk's stored bytes (docs/architecture.md, Definitions: chunk key)."""

    model_fingerprint: str
    kv_dtype: str
    """The stored K/V dtype, e.g. "float32"."""
    tp_size: int = 1
    tp_rank: int = 0
    config_hash: str = ""
    """CacheFuseConfig.compute_hash(): the config fields that change stored bytes."""
    paged_cache_dtype: str = "auto"
    """The serving engine's paged KV cache when it is quantized (`paged_cache_dtype_name`), else "auto".
    Entries stay in `kv_dtype` either way, but a chunk computed by an engine over an fp8 cache attended
    over fp8-rounded K/V at every layer: its K/V differ from the same chunk's over an unquantized cache,
    and a system chunk is reused as exact, so the two engines never share entries."""

    def __post_init__(self) -> None:
        if not (_is_int(self.tp_size) and self.tp_size >= 1):
            raise ConfigError(f"tp_size={self.tp_size!r}, expected an int >= 1")
        if not (_is_int(self.tp_rank) and 0 <= self.tp_rank < self.tp_size):
            raise ConfigError(f"tp_rank={self.tp_rank!r}, expected an int in 0..{self.tp_size - 1}")


def dtype_name(dtype: Any) -> str:
    """`KeyContext.kv_dtype` of a torch dtype (or its name): "float32" for torch.float32 or "float32"."""
    return str(dtype).removeprefix("torch.")


def paged_cache_dtype_name(cache_dtype: str, model_dtype: Any) -> str:
    """`KeyContext.paged_cache_dtype` of vLLM's `cache_config.cache_dtype`: "auto" for a cache in the
    model's dtype (however named), "fp8_e4m3" for "fp8" (vLLM stores the same bytes for both), else the
    name as given ("fp8_e5m2")."""
    if cache_dtype in ("auto", dtype_name(model_dtype)):
        return "auto"
    return "fp8_e4m3" if cache_dtype == "fp8" else cache_dtype


def chunk_key(token_ids: Sequence[int], ctx: KeyContext, *, at_prompt_start: bool = False) -> str:
    """The store key of a chunk: its content and `ctx`, never its position or prefix; and whether it
    was computed at the start of a prompt, with nothing before it.

    A chunk at offset 0 (the system chunk) is reused as exact, with no row recomputed, so its entry
    must hold K/V computed at positions 0..n-1 after nothing: that is a different entry from the same
    text computed after anything else (a system prompt, a BOS token, glue), which is only ever reused
    approximately. `at_prompt_start` keys the two apart, so one request's hole can never be served
    as another request's exact system chunk.

    Args:
        token_ids: the chunk's ids as tokenized on its own, [num_tokens].
        ctx: model, dtype, paged cache, tensor-parallel and config identity.
        at_prompt_start: the chunk sits at offset 0 (computed after nothing).

    Returns:
        32 hex characters of a sha256 over `ctx`, the start flag and the ids as little-endian int64.
    """
    fields = [ctx.model_fingerprint, ctx.kv_dtype, ctx.tp_size, ctx.tp_rank, ctx.config_hash, len(token_ids)]
    if at_prompt_start:  # appended only when set: every other key is what it always was
        fields.append("at_prompt_start")
    if ctx.paged_cache_dtype != "auto":  # likewise: an unquantized engine's keys are unchanged
        fields.append(f"paged_cache={ctx.paged_cache_dtype}")
    header = json.dumps(fields).encode()
    h = hashlib.sha256(_KEY_VERSION)
    h.update(struct.pack("<Q", len(header)))
    h.update(header)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.hexdigest()[:32]


_PLACE_VERSION = b"cachefuse-exact-place-v1"


def place_hashes(token_ids: Sequence[int], starts: Sequence[int]) -> list[str]:
    """For each offset in `starts`, the hash of exactly the tokens before it: `token_ids[:start]`.

    A variant records the place its K/V were computed in (`VariantRecord.exact_after`) as this hash of
    everything before the chunk in that prompt (system prompt, glue, earlier chunks); a prompt that puts
    the chunk after the same tokens finds the same hash. One sha256 pass over the prompt however many
    chunks (the scheduler calls it in `schedule()`): the running digest is copied at each start.

    Args:
        token_ids: the prompt's ids.
        starts: offsets in 0..len(token_ids), ascending.

    Returns:
        32 hex characters per start.
    """
    h = hashlib.sha256(_PLACE_VERSION)
    out, done = [], 0
    for start in starts:
        if start < done:
            raise ValueError(f"starts must ascend: {start} after {done}")
        h.update(struct.pack(f"<{start - done}q", *token_ids[done:start]))
        out.append(h.copy().hexdigest()[:32])
        done = start
    return out


def place_hash(prefix_ids: Sequence[int]) -> str:
    """The hash of the place after exactly `prefix_ids` (`place_hashes` of one start)."""
    return place_hashes(prefix_ids, [len(prefix_ids)])[0]


# --------------------------------------------------------------------------- segments


@dataclass(frozen=True)
class Segment:
    """A token range of a request's prompt: a declared chunk or a range computed in full."""

    start: int
    length: int
    is_chunk: bool
    """A declared chunk, looked up in the store; else glue, question or an undeclared prefix."""
    is_system: bool
    """The declared chunk at offset 0: the system prompt, exact since it never moves."""

    @property
    def end(self) -> int:
        return self.start + self.length


def is_candidate_chunk(is_system: bool, at_exact_place: bool) -> bool:
    """Whether a loaded chunk's rows are candidates for recompute: a loaded chunk's are, unless its K/V are
    already a full prefill's there, because it is the system chunk (offset 0, keyed as computed after
    nothing) or is reused at its exact place (`place_hashes`; `VariantChoice.exact`, `ChunkReuse.exact`).

    The one statement of the rule. The selector's candidate rows, the recompute ratio's denominator, the
    scheduler's row estimates and the controller's shape, the chunks admission may recompute, and the
    rows a hole save counts as exact all follow it.
    """
    return not (is_system or at_exact_place)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_chunks(num_tokens: int, chunks: Any) -> list[tuple[int, int]]:
    """Validates `kv_transfer_params["cachefuse"]["chunks"]`; raises RequestError naming the entry."""
    if not isinstance(chunks, (list, tuple)):
        raise RequestError(
            f"{PARAMS_KEY}.chunks", f"got {reprlib.repr(chunks)}; expected a list of [start, end] token offsets"
        )
    out: list[tuple[int, int]] = []
    for i, pair in enumerate(chunks):
        field = f"{PARAMS_KEY}.chunks[{i}]"
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(_is_int(x) for x in pair)):
            raise RequestError(field, f"got {reprlib.repr(pair)}; expected a pair [start, end] of ints")
        start, end = pair
        if not 0 <= start < end <= num_tokens:
            raise RequestError(
                field, f"got [{start}, {end}]; expected 0 <= start < end <= {num_tokens} (the prompt length)"
            )
        if out and start < out[-1][0]:
            raise RequestError(
                field,
                f"starts at {start}, before the previous chunk's start {out[-1][0]}; expected sorted chunks",
            )
        if out and start < out[-1][1]:
            prev = out[-1]
            raise RequestError(
                field,
                f"[{start}, {end}] overlaps the previous chunk [{prev[0]}, {prev[1]}]; expected disjoint chunks",
            )
        out.append((start, end))
    return out


def segment_prompt(num_tokens: int, chunks: Any) -> list[Segment]:
    """Splits a prompt into declared chunks and the computed ranges between them.

    Args:
        num_tokens: prompt length N.
        chunks: the request's `[start, end)` token offsets, sorted and disjoint, within [0, N).

    Returns:
        Segments tiling [0, N) in order: each declared chunk (`is_chunk`, and `is_system` for the one
        at offset 0) and every gap as a computed segment. Empty for N == 0.

    Raises:
        RequestError: `chunks` is malformed; `field` names the entry, e.g. "cachefuse.chunks[2]".
    """
    if not (_is_int(num_tokens) and num_tokens >= 0):
        raise ValueError(f"num_tokens={num_tokens!r}, expected an int >= 0")
    segments: list[Segment] = []
    pos = 0
    for start, end in _check_chunks(num_tokens, chunks):
        if start > pos:
            segments.append(Segment(pos, start - pos, is_chunk=False, is_system=False))
        segments.append(Segment(start, end - start, is_chunk=True, is_system=start == 0))
        pos = end
    if pos < num_tokens:
        segments.append(Segment(pos, num_tokens - pos, is_chunk=False, is_system=False))
    return segments


def chunks_from_texts(prompt_ids: Sequence[int], chunk_ids: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Locates chunks given by their standalone token ids in a prompt (the `chunk_texts` form).

    Each chunk is matched as an exact contiguous subsequence, in order: the search for chunk i
    starts where chunk i-1's match ended, so matches are sorted and disjoint.

    Args:
        prompt_ids: the prompt's ids, [N].
        chunk_ids: each chunk's ids as tokenized on its own.

    Returns:
        `[start, end)` offsets, one per chunk.

    Raises:
        RequestError: a chunk is empty or not found; field "cachefuse.chunk_texts[i]".
    """
    haystack = _one_char_per_token(prompt_ids, "prompt token ids")
    out: list[tuple[int, int]] = []
    pos = 0  # in tokens
    for i, ids in enumerate(chunk_ids):
        field = f"cachefuse.chunk_texts[{i}]"
        if len(ids) == 0:
            raise RequestError(field, "tokenizes to no tokens; expected a non-empty chunk text")
        start = haystack.find(_one_char_per_token(ids, field), pos)
        if start == -1:
            raise RequestError(
                field, "not found as an exact token subsequence of the prompt after standalone tokenization"
            )
        out.append((start, start + len(ids)))
        pos = start + len(ids)
    return out


_SURROGATES, _LAST_CODE_POINT = 0xD800, 0x10FFFF


def _one_char_per_token(ids: Sequence[int], field: str) -> str:
    """`ids` as a string of one code point each (skipping the surrogate range), so `str.find` matches whole
    tokens only, in linear time. As bytes, a match could start inside a token and was retried one byte
    on: a client's prompt and chunk text could make every position such a near match (quadratic work in
    the scheduler's step: 1.6 s for 32K tokens)."""
    try:
        return "".join(chr(i + 0x800 if i >= _SURROGATES else i) for i in ids)
    except (ValueError, OverflowError, TypeError):
        raise RequestError(field, f"holds a token id outside 0..{_LAST_CODE_POINT - 0x800}") from None

"""cachefuse.chunks: model fingerprint, chunk keys, segmentation, locating chunk texts."""

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefuse import chunks
from cachefuse.chunks import (
    KeyContext,
    Segment,
    chunk_key,
    chunks_from_texts,
    is_candidate_chunk,
    model_fingerprint,
    segment_prompt,
)
from cachefuse.errors import ConfigError, RequestError

CTX = KeyContext(model_fingerprint="f" * 32, kv_dtype="float32", tp_size=2, tp_rank=1, config_hash="c0ffee")


def _data_start(path: Path) -> int:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    return 8 + header_len


def _write_safetensors(path: Path, num_bytes: int) -> None:
    """A one-tensor uint8 safetensors file of `num_bytes` data bytes, written without torch."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [num_bytes], "data_offsets": [0, num_bytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.write(bytes(range(256)) * (num_bytes // 256) + bytes(num_bytes % 256))


@pytest.fixture
def llama_copy(tiny_model_dir, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_model_dir("llama"), tmp_path / "llama"))


# --------------------------------------------------------------------------- model_fingerprint


def test_fingerprint_stable(llama_copy):
    fp = model_fingerprint(llama_copy)
    assert fp == model_fingerprint(str(llama_copy))
    assert len(fp) == 32 and int(fp, 16) >= 0


def test_fingerprint_config_canonical_and_sensitive(llama_copy):
    fp = model_fingerprint(llama_copy)
    config_path = llama_copy / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config, indent=7, sort_keys=False))  # same content, other bytes
    assert model_fingerprint(llama_copy) == fp
    config["rms_norm_eps"] = 1e-5
    config_path.write_text(json.dumps(config))
    assert model_fingerprint(llama_copy) != fp


def test_fingerprint_weight_byte(llama_copy):
    fp = model_fingerprint(llama_copy)
    weights = llama_copy / "model.safetensors"
    offset = _data_start(weights) + 1234  # inside the first sampled 4 KiB of the data region
    data = bytearray(weights.read_bytes())
    data[offset] ^= 0x01
    weights.write_bytes(bytes(data))
    assert model_fingerprint(llama_copy) != fp


def test_fingerprint_sees_a_change_to_some_tensors_only(llama_copy):
    """A merged attention-only adapter: q/k/v/o of one layer change, every other tensor stays, and so do
    the first, middle and last 4 KiB of the file's data (what the fingerprint once sampled, which gave
    such a checkpoint the base model's keys and stored K/V)."""
    fp = model_fingerprint(llama_copy)
    weights = llama_copy / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    start = _data_start(weights)
    header = json.loads(raw[8:start])
    data_len = len(raw) - start
    file_windows = [(0, 4096), (data_len // 2 - 2048, data_len // 2 + 2048), (data_len - 4096, data_len)]
    changed = 0
    for name, spec in header.items():
        begin, end = spec["data_offsets"] if name != "__metadata__" else (0, 0)
        if "layers.1.self_attn" not in name or any(begin < e and s < end for s, e in file_windows):
            continue
        for offset in range(start + begin, start + end, 4):  # scale every fp32 weight by 1.5
            (value,) = struct.unpack_from("<f", raw, offset)
            struct.pack_into("<f", raw, offset, value * 1.5)
        changed += 1
    assert changed >= 2  # the scenario holds: whole tensors changed, the file's windows not
    weights.write_bytes(bytes(raw))
    assert model_fingerprint(llama_copy) != fp


def test_fingerprint_weight_file_renamed_or_added(llama_copy):
    fp = model_fingerprint(llama_copy)
    _write_safetensors(llama_copy / "extra.safetensors", 100)
    assert model_fingerprint(llama_copy) != fp


def test_fingerprint_reads_bounded_bytes(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    weights = tmp_path / "model.safetensors"
    _write_safetensors(weights, 8 << 20)
    num_read = 0

    class CountingFile:
        def __init__(self, f):
            self._f = f

        def read(self, n=-1):
            nonlocal num_read
            assert n >= 0, "an unbounded read"
            out = self._f.read(n)
            num_read += len(out)
            return out

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    monkeypatch.setattr(chunks, "open", lambda *a, **k: CountingFile(open(*a, **k)), raising=False)
    model_fingerprint(tmp_path)
    assert 0 < num_read <= _data_start(weights) + 3 * 4096


def test_fingerprint_missing_files(tmp_path):
    with pytest.raises(ConfigError, match=r"model: no config\.json"):
        model_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"model: no \*\.safetensors") as e:
        model_fingerprint(tmp_path)
    assert str(tmp_path) in str(e.value)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(ConfigError, match="header of 1000 bytes"):
        model_fingerprint(tmp_path)


# --------------------------------------------------------------------------- chunk_key


def test_chunk_key_content_only():
    ids = [5, 17, 900, 3]
    prompt_a = [1, 2, 3] + ids + [7]
    prompt_b = [9] * 50 + ids
    key = chunk_key(ids, CTX)
    assert key == chunk_key(prompt_a[3:7], CTX) == chunk_key(tuple(prompt_b[50:]), CTX)
    assert len(key) == 32
    assert chunk_key(ids[::-1], CTX) != key
    assert chunk_key(ids[:-1], CTX) != key
    assert chunk_key(ids + [0], CTX) != key
    assert chunk_key([2**40 + 5, 17, 900, 3], CTX) != key


@pytest.mark.parametrize(
    "field, value",
    [
        ("model_fingerprint", "e" * 32),
        ("kv_dtype", "bfloat16"),
        ("tp_size", 4),
        ("tp_rank", 0),
        ("config_hash", ""),
        ("paged_cache_dtype", "fp8_e4m3"),
    ],
)
def test_chunk_key_depends_on_each_ctx_field(field, value):
    ids = [5, 17, 900, 3]
    assert chunk_key(ids, dataclasses.replace(CTX, **{field: value})) != chunk_key(ids, CTX)


def test_paged_cache_dtype_keys_fp8_engines_apart_and_names_one_format_once():
    """An engine over an fp8 cache computes other K/V than one over an unquantized cache: their keys
    differ. The model's dtype named outright is "auto"'s cache, and "fp8" is e4m3's bytes: those share."""
    def key(cache_dtype):
        ctx = dataclasses.replace(CTX, paged_cache_dtype=chunks.paged_cache_dtype_name(cache_dtype, "torch.float32"))
        return chunk_key([5, 17, 900, 3], ctx)

    assert key("auto") == key("float32") == chunk_key([5, 17, 900, 3], CTX)
    assert key("fp8") == key("fp8_e4m3")
    assert len({key("auto"), key("fp8_e4m3"), key("fp8_e5m2")}) == 3


@pytest.mark.parametrize("tp_size, tp_rank", [(0, 0), (2, 2), (2, -1), (True, 0)])
def test_key_context_rejects_bad_tp(tp_size, tp_rank):
    with pytest.raises(ConfigError):
        KeyContext("f" * 32, "float32", tp_size=tp_size, tp_rank=tp_rank)


# --------------------------------------------------------------------------- segment_prompt


def test_segment_prompt_example():
    segments = segment_prompt(20, [[0, 4], [6, 10], (10, 13)])
    assert segments == [
        Segment(0, 4, is_chunk=True, is_system=True),
        Segment(4, 2, is_chunk=False, is_system=False),
        Segment(6, 4, is_chunk=True, is_system=False),
        Segment(10, 3, is_chunk=True, is_system=False),
        Segment(13, 7, is_chunk=False, is_system=False),
    ]
    assert segments[-1].end == 20


def test_segment_prompt_edges():
    assert segment_prompt(0, []) == []
    assert segment_prompt(5, []) == [Segment(0, 5, is_chunk=False, is_system=False)]
    assert segment_prompt(5, [[2, 5]]) == [
        Segment(0, 2, is_chunk=False, is_system=False),
        Segment(2, 3, is_chunk=True, is_system=False),
    ]


@pytest.mark.parametrize(
    "is_system, at_exact_place, candidate",
    [
        (True, False, False),  # the system chunk: computed after nothing, exact by its key
        (False, True, False),  # a chunk reused at its exact place
        (True, True, False),
        # negative control: any other loaded chunk is a candidate (a rule that turned every chunk away
        # would pass the three rows above)
        (False, False, True),
    ],
)
def test_is_candidate_chunk(is_system, at_exact_place, candidate):
    assert is_candidate_chunk(is_system, at_exact_place) is candidate


@st.composite
def prompts_with_chunks(draw):
    num_tokens = draw(st.integers(0, 200))
    cuts = sorted(set(draw(st.lists(st.integers(0, num_tokens), max_size=12))))
    pairs = [[a, b] for a, b in zip(cuts[::2], cuts[1::2], strict=False) if a < b]
    return num_tokens, pairs


@settings(max_examples=200, deadline=None)
@given(prompts_with_chunks())
def test_segment_prompt_tiles(case):
    num_tokens, pairs = case
    segments = segment_prompt(num_tokens, pairs)
    pos = 0
    for seg in segments:
        assert seg.start == pos and seg.length > 0
        pos = seg.end
    assert pos == num_tokens
    assert [[s.start, s.end] for s in segments if s.is_chunk] == pairs
    assert [s.is_system for s in segments] == [s.is_chunk and s.start == 0 for s in segments]
    for a, b in zip(segments, segments[1:], strict=False):
        assert a.is_chunk or b.is_chunk  # computed gaps are merged, never adjacent


@pytest.mark.parametrize(
    "bad, field, reason",
    [
        ([[0, 4], [3, 6]], "cachefuse.chunks[1]", "overlaps"),
        ([[0, 4], [0, 2]], "cachefuse.chunks[1]", "overlaps"),
        ([[5, 8], [0, 4]], "cachefuse.chunks[1]", "sorted"),
        ([[0, 4], [5, 11]], "cachefuse.chunks[1]", "<= 10"),
        ([[3, 3]], "cachefuse.chunks[0]", "start < end"),
        ([[-1, 3]], "cachefuse.chunks[0]", "0 <= start"),
        ([[0, 2], [True, 4]], "cachefuse.chunks[1]", "pair [start, end] of ints"),
        ([[0, 2.0]], "cachefuse.chunks[0]", "pair [start, end] of ints"),
        ([["0", "2"]], "cachefuse.chunks[0]", "pair [start, end] of ints"),
        ([[0, 2], [3, 4, 5]], "cachefuse.chunks[1]", "pair"),
        ([[0]], "cachefuse.chunks[0]", "pair"),
        ([[[0, 2]]], "cachefuse.chunks[0]", "pair"),
        ([3], "cachefuse.chunks[0]", "pair"),
        ("0,4", "cachefuse.chunks", "expected a list"),
        ({"0": 4}, "cachefuse.chunks", "expected a list"),
        (None, "cachefuse.chunks", "expected a list"),
    ],
)
def test_segment_prompt_rejects_malformed(bad, field, reason):
    with pytest.raises(RequestError) as e:
        segment_prompt(10, bad)
    assert e.value.field == field
    assert reason in e.value.reason
    assert "expected" in e.value.reason


# --------------------------------------------------------------------------- chunks_from_texts


def test_chunks_from_texts_found_in_order():
    prompt = [1, 7, 8, 9, 2, 7, 8, 9, 3, 4]
    assert chunks_from_texts(prompt, [[7, 8, 9], [7, 8, 9], [4]]) == [(1, 4), (5, 8), (9, 10)]
    assert chunks_from_texts(prompt, []) == []
    # a byte-level match that is not token-aligned must not count
    assert chunks_from_texts([256, 0, 1], [[1]]) == [(2, 3)]


@pytest.mark.parametrize(
    "chunk_ids, index",
    [([[5, 6]], 0), ([[2, 3], [1, 2]], 1), ([[1, 2], [2, 3]], 1), ([[1], []], 1)],
)
def test_chunks_from_texts_not_found(chunk_ids, index):
    with pytest.raises(RequestError) as e:
        chunks_from_texts([1, 2, 3, 4], chunk_ids)
    assert e.value.field == f"cachefuse.chunk_texts[{index}]"


def test_chunks_from_texts_matches_whole_tokens_only_in_linear_time():
    """A client could make every prompt position a near match one byte inside a token (8192 = 32 * 256:
    as 8-byte strings, "0"'s id 32 repeated matches one byte into 8192 repeated), and the scheduler retried
    each one: quadratic in the prompt. Matches are whole tokens; this prompt finishes at once."""
    prompt = [256 * 32] * 65536
    with pytest.raises(RequestError, match=r"chunk_texts\[0\]"):
        chunks_from_texts(prompt, [[32] * 32768])
    # ids on both sides of the surrogate range stay distinct, large ids too
    ids = [0, 0xD7FF, 0xD800, 0xDFFF, 0xE000, 262143, 5]
    assert chunks_from_texts(ids, [[0xD800, 0xDFFF], [262143]]) == [(2, 4), (5, 6)]
    with pytest.raises(RequestError, match="token id outside"):
        chunks_from_texts([1, 2, -1], [[2]])

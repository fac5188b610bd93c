"""cachefuse.request: parsing and validating `kv_transfer_params["cachefuse"]`.

Pins that a request without cachefuse params is plain vLLM (unless the separator fallback applies),
that valid chunks parse with the config's defaults and per-request overrides, that `chunk_texts` are
located through the tokenize callable, and that every malformed field raises RequestError naming it.
"""

import math

import pytest

from cachefuse.config import CacheFuseConfig
from cachefuse.errors import RequestError
from cachefuse.request import FusionRequest, parse_request, wants_fusion

CFG = CacheFuseConfig()
DEBUG_CFG = CacheFuseConfig(allow_debug_overrides=True)
PROMPT = list(range(100, 120))  # 20 tokens
TEXT = "Be brief. Paris is in France. Rome is in Italy. Paris is in France. Where is Rome?"


def char_ids(text: str) -> list[int]:
    """A trivial deterministic tokenizer: one id per character."""
    return [ord(c) for c in text]


def _parse(fields, prompt=PROMPT, config=CFG, tokenize=None):
    return parse_request({"cachefuse": fields}, prompt, config, tokenize)


@pytest.mark.parametrize("params", [None, {}, {"other_connector": {"x": 1}}, ["cachefuse"]])
def test_request_without_cachefuse_params_is_plain_vllm(params):
    assert wants_fusion(params, CFG) is False
    assert parse_request(params, PROMPT, CFG) is None


def test_request_with_cachefuse_params_wants_fusion():
    assert wants_fusion({"cachefuse": {"chunks": [[0, 4]]}}, CFG) is True


def test_separator_fallback_splits_the_prompt_between_separators():
    config = CacheFuseConfig(separator_token_id=0, selector="epic", recompute_ratio=0.3)
    assert wants_fusion(None, config) is True
    got = parse_request(None, [5, 6, 0, 7, 8, 9, 0, 0, 3, 0, 4, 4], config)
    # Separators and the question after the last one are computed; empty pieces are no chunks.
    assert got == FusionRequest(((0, 2), (3, 6), (8, 9)), "epic", 0.3)


def test_separator_fallback_without_a_separator_in_the_prompt_is_plain_vllm():
    assert parse_request({}, [5, 6, 7], CacheFuseConfig(separator_token_id=0)) is None


def test_declared_chunks_take_precedence_over_the_separator_fallback():
    config = CacheFuseConfig(separator_token_id=0)
    got = parse_request({"cachefuse": {"chunks": [[1, 3]]}}, [5, 0, 6, 7, 0, 8], config)
    assert got.chunks == ((1, 3),)


def test_valid_chunks_parse_with_the_config_defaults():
    got = _parse({"chunks": [[0, 4], [4, 9], (12, 19)]})
    assert got == FusionRequest(((0, 4), (4, 9), (12, 19)), "cacheblend", 0.15, None)
    config = CacheFuseConfig(selector="random", recompute_ratio=0.4)
    assert _parse({"chunks": [[2, 5]]}, config=config) == FusionRequest(((2, 5),), "random", 0.4)


@pytest.mark.parametrize("selector", ["full_prefill", "epic", "cachecraft"])
@pytest.mark.parametrize("ratio", [0, 0.5, 1])
def test_per_request_selector_and_ratio_override_the_config(selector, ratio):
    got = _parse({"chunks": [[0, 4]], "selector": selector, "recompute_ratio": ratio})
    assert (got.selector, got.recompute_ratio) == (selector, float(ratio))
    assert isinstance(got.recompute_ratio, float)


def test_selected_rows_are_sorted_and_deduplicated_when_allowed():
    got = _parse({"chunks": [[0, 4]], "selected_rows": [7, 2, 19, 2, 0]}, config=DEBUG_CFG)
    assert got.selected_rows == (0, 2, 7, 19)


@pytest.mark.parametrize(("fields", "field"), [
    ([[0, 4]], "cachefuse"),
    ({"chunks": [[0, 4]], "bogus": 1}, "cachefuse.bogus"),
    ({}, "cachefuse"),
    ({"selector": "epic"}, "cachefuse"),
    ({"chunks": [[0, 4]], "chunk_texts": ["a"]}, "cachefuse"),
    ({"chunks": "0-4"}, "cachefuse.chunks"),
    ({"chunks": [[0, 2], [3]]}, "cachefuse.chunks[1]"),
    ({"chunks": [[0, 2.0]]}, "cachefuse.chunks[0]"),
    ({"chunks": [[0, True]]}, "cachefuse.chunks[0]"),
    ({"chunks": [[0, 2], [4, 6], [8, 8]]}, "cachefuse.chunks[2]"),
    ({"chunks": [[-1, 2]]}, "cachefuse.chunks[0]"),
    ({"chunks": [[0, 2], [18, 21]]}, "cachefuse.chunks[1]"),
    ({"chunks": [[5, 8], [0, 3]]}, "cachefuse.chunks[1]"),
    ({"chunks": [[0, 5], [4, 8]]}, "cachefuse.chunks[1]"),
    ({"chunks": [[0, 3], [10, 20]]}, "cachefuse.chunks[1]"),  # reaches the last prompt token
    ({"chunks": [[0, 20]]}, "cachefuse.chunks[0]"),
    ({"chunks": [[0, 4]], "selector": "nope"}, "cachefuse.selector"),
    ({"chunks": [[0, 4]], "selector": None}, "cachefuse.selector"),
    ({"chunks": [[0, 4]], "recompute_ratio": 1.5}, "cachefuse.recompute_ratio"),
    ({"chunks": [[0, 4]], "recompute_ratio": -0.1}, "cachefuse.recompute_ratio"),
    ({"chunks": [[0, 4]], "recompute_ratio": "0.2"}, "cachefuse.recompute_ratio"),
    ({"chunks": [[0, 4]], "recompute_ratio": True}, "cachefuse.recompute_ratio"),
    ({"chunks": [[0, 4]], "recompute_ratio": None}, "cachefuse.recompute_ratio"),
    ({"chunks": [[0, 4]], "recompute_ratio": math.nan}, "cachefuse.recompute_ratio"),
    ({"chunks": [[0, 4]], "selected_rows": [1]}, "cachefuse.selected_rows"),  # not allowed by default
])
def test_malformed_field_raises_request_error_naming_it(fields, field):
    with pytest.raises(RequestError) as excinfo:
        _parse(fields)
    assert excinfo.value.field == field
    assert str(excinfo.value).startswith(f"{field}: ")


@pytest.mark.parametrize("rows", ["1,2", [1, True], [1.0], [20], [-1]])
def test_malformed_selected_rows_raise_even_when_allowed(rows):
    with pytest.raises(RequestError) as excinfo:
        _parse({"chunks": [[0, 4]], "selected_rows": rows}, config=DEBUG_CFG)
    assert excinfo.value.field == "cachefuse.selected_rows"


def _span(text: str, start: int = 0) -> tuple[int, int]:
    at = TEXT.index(text, start)
    return at, at + len(text)


def test_chunk_texts_are_located_through_the_tokenizer_in_order():
    first, second = _span("Be brief. "), _span("Paris is in France. ")
    third = _span("Paris is in France. ", second[1])  # a repeated text matches its next occurrence
    texts = ["Be brief. ", "Paris is in France. ", "Paris is in France. "]
    got = _parse({"chunk_texts": texts, "recompute_ratio": 0.5}, prompt=char_ids(TEXT), tokenize=char_ids)
    assert got == FusionRequest((first, second, third), "cacheblend", 0.5)


@pytest.mark.parametrize(("texts", "tokenize", "field"), [
    (["Rome is in Italy. ", "Berlin"], char_ids, "cachefuse.chunk_texts[1]"),  # not in the prompt
    (["Rome is in Italy. ", "Paris is in France. Rome"], char_ids, "cachefuse.chunk_texts[1]"),  # out of order
    (["Rome", ""], char_ids, "cachefuse.chunk_texts[1]"),
    ([3], char_ids, "cachefuse.chunk_texts[0]"),
    ("Rome", char_ids, "cachefuse.chunk_texts"),
    ([], char_ids, "cachefuse.chunk_texts"),
    (["Rome"], None, "cachefuse.chunk_texts"),
    (["Rome"], lambda text: [], "cachefuse.chunk_texts[0]"),
])
def test_malformed_chunk_texts_raise_request_error_naming_the_entry(texts, tokenize, field):
    with pytest.raises(RequestError) as excinfo:
        _parse({"chunk_texts": texts}, prompt=char_ids(TEXT), tokenize=tokenize)
    assert excinfo.value.field == field


def test_chunk_text_reaching_the_prompt_end_is_rejected():
    with pytest.raises(RequestError) as excinfo:
        _parse({"chunk_texts": ["Where is Rome?"]}, prompt=char_ids(TEXT), tokenize=char_ids)
    # Today the error names the offsets form ("cachefuse.chunks[0]"), not the chunk_texts entry.
    assert excinfo.value.field in {"cachefuse.chunks[0]", "cachefuse.chunk_texts[0]"}

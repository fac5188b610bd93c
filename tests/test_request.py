"""cachefuse.request: parsing and validating `kv_transfer_params["cachefuse"]`.

Pins that a request without cachefuse params is plain vLLM (unless the separator fallback applies),
that valid chunks parse with the config's defaults and per-request overrides, that `chunk_texts` are
located through the tokenize callable, and that every malformed field raises RequestError naming it.
"""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefuse.chunks import segment_prompt
from cachefuse.config import CacheFuseConfig
from cachefuse.errors import RequestError, RequestLimitError
from cachefuse.request import FusionRequest, parse_request, wants_fusion
from tests.helpers.hostile import kv_transfer_params

CFG = CacheFuseConfig()
DEBUG_CFG = CacheFuseConfig(allow_debug_overrides=True)
PROMPT = list(range(100, 120))  # 20 tokens
TEXT = "Be brief. Paris is in France. Rome is in Italy. Paris is in France. Where is Rome?"


def char_ids(text: str) -> list[int]:
    """A trivial deterministic tokenizer: one id per character."""
    return [ord(c) for c in text]


def _fusion(chunks, selector, ratio, num_tokens=None):
    """The FusionRequest parse_request returns for `chunks` in a prompt of `num_tokens` (PROMPT's)."""
    num_tokens = len(PROMPT) if num_tokens is None else num_tokens
    return FusionRequest(segments=tuple(segment_prompt(num_tokens, chunks)), selector=selector, recompute_ratio=ratio)


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
    # Separators and the question after the last one are computed; empty pieces are no chunks, and
    # neither are pieces shorter than min_chunk_tokens (2 by default): [3] is computed.
    assert got == _fusion(((0, 2), (3, 6)), "epic", 0.3, num_tokens=12)
    one = parse_request(None, [5, 6, 0, 7, 8, 9, 0, 0, 3, 0, 4, 4], config.replace(min_chunk_tokens=1))
    assert one == _fusion(((0, 2), (3, 6), (8, 9)), "epic", 0.3, num_tokens=12)


def test_separator_fallback_without_a_separator_in_the_prompt_is_plain_vllm():
    assert parse_request({}, [5, 6, 7], CacheFuseConfig(separator_token_id=0)) is None


def test_declared_chunks_take_precedence_over_the_separator_fallback():
    config = CacheFuseConfig(separator_token_id=0)
    got = parse_request({"cachefuse": {"chunks": [[1, 3]]}}, [5, 0, 6, 7, 0, 8], config)
    assert got.chunks == ((1, 3),)


def test_valid_chunks_parse_with_the_config_defaults():
    got = _parse({"chunks": [[0, 4], [4, 9], (12, 19)]})
    assert got == _fusion(((0, 4), (4, 9), (12, 19)), "cacheblend", 0.15)
    config = CacheFuseConfig(selector="random", recompute_ratio=0.4)
    assert _parse({"chunks": [[2, 5]]}, config=config) == _fusion(((2, 5),), "random", 0.4)


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
    assert got == _fusion((first, second, third), "cacheblend", 0.5, num_tokens=len(char_ids(TEXT)))


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


# --------------------------------------------------------------------------- hostile input and bounds


def _nested(depth: int):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(("fields", "field"), [
    (None, "cachefuse"),  # {"cachefuse": null}: says why it runs plain, instead of silently
    ({"chunks": []}, "cachefuse.chunks"),
    ({"chunks": [[0, 4]], 7: 1}, "cachefuse.7"),  # a non-string key
    ({"chunks": [[0, 4]], ("a",): 1}, "cachefuse.('a',)"),
    ({"chunks": [[0, 4]], "x" * 1000: 1}, "cachefuse.'" + "x" * 17 + "..."),  # a long key, cut
    ({"chunks": [[0, 4]], "selector": _nested(1000)}, "cachefuse.selector"),
    ({"chunks": [[0, 4]], "recompute_ratio": _nested(1000)}, "cachefuse.recompute_ratio"),
    ({"chunks": _nested(1000)}, "cachefuse.chunks[0]"),
    ({"chunks": [[0, 4]], "selector": "s" * (4 << 20)}, "cachefuse.selector"),
    ({"chunk_texts": ["Paris\ud800"]}, "cachefuse.chunk_texts[0]"),  # a lone surrogate
    ({"chunk_texts": [_nested(1000)]}, "cachefuse.chunk_texts[0]"),
])
def test_hostile_input_is_a_request_error_with_a_bounded_excerpt(fields, field):
    with pytest.raises(RequestError) as excinfo:
        parse_request({"cachefuse": fields}, PROMPT, CFG, char_ids)
    assert excinfo.value.field.startswith(field)
    assert len(str(excinfo.value)) < 300  # never the client's value itself


def test_a_tokenizer_that_fails_or_returns_garbage_is_the_fields_error():
    def broken(text):
        raise UnicodeDecodeError("utf-8", b"", 0, 1, "bad")

    for tokenize in (broken, lambda text: ["a"], lambda text: [1.5], lambda text: None):
        with pytest.raises(RequestError) as excinfo:
            parse_request({"cachefuse": {"chunk_texts": ["Paris"]}}, [ord(c) for c in TEXT], CFG, tokenize)
        assert excinfo.value.field == "cachefuse.chunk_texts[0]"


@pytest.mark.parametrize(("fields", "config", "field"), [
    ({"chunks": [[i, i + 2] for i in range(0, 258, 2)]}, CFG, "cachefuse.chunks"),  # 129 > 128
    ({"chunks": [[0, 4], [5, 6]]}, CFG, "cachefuse.chunks[1]"),  # 1 token < min_chunk_tokens 2
    ({"chunks": [[0, 4], [5, 8]]}, CFG.replace(min_chunk_tokens=4), "cachefuse.chunks[1]"),
    ({"chunk_texts": ["Paris"] * 3}, CFG.replace(max_chunks_per_request=2), "cachefuse.chunk_texts"),
    ({"chunk_texts": ["Paris is in France."]}, CFG.replace(max_chunk_text_bytes=10), "cachefuse.chunk_texts"),
])
def test_requests_beyond_the_bounds_raise_request_limit_error(fields, config, field):
    prompt = list(range(300)) if "chunks" in fields else [ord(c) for c in TEXT]
    with pytest.raises(RequestLimitError) as excinfo:
        parse_request({"cachefuse": fields}, prompt, config, char_ids)
    assert excinfo.value.field == field


def test_the_text_budget_is_checked_before_anything_is_tokenized():
    calls = []

    def spy(text):
        calls.append(text)
        return char_ids(text)

    texts = ["Paris is in France.", "x" * 100]
    with pytest.raises(RequestLimitError):
        parse_request({"cachefuse": {"chunk_texts": texts}}, [ord(c) for c in TEXT], CFG.replace(
            max_chunk_text_bytes=50), spy)
    assert calls == []


def test_separator_pieces_beyond_the_chunk_bound_raise():
    config = CacheFuseConfig(separator_token_id=0, max_chunks_per_request=3)
    prompt = [5, 6, 0] * 4 + [9]
    with pytest.raises(RequestLimitError):
        parse_request(None, prompt, config)
    assert parse_request(None, [5, 6, 0] * 3 + [9], config).chunks == ((0, 2), (3, 5), (6, 8))


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=kv_transfer_params, separator=st.none() | st.integers(0, 3))
def test_generated_params_parse_or_raise_request_error_only(params, separator):
    config = CacheFuseConfig(separator_token_id=separator, allow_debug_overrides=separator == 1)
    prompt = [ord(c) for c in TEXT] + [0, 1, 2, 3] * 4
    try:
        got = parse_request(params, prompt, config, char_ids)
    except RequestError as exc:
        assert len(str(exc)) < 500 and exc.field.startswith("cachefuse")
        return
    assert got is None or (got.chunks and all(0 <= s < e < len(prompt) for s, e in got.chunks))


SYNC_SAVE_CFG = CacheFuseConfig(allow_sync_save=True)


@pytest.mark.parametrize("value", [1, "yes", None, [True]])
def test_sync_save_must_be_a_boolean(value):
    with pytest.raises(RequestError, match=r"cachefuse\.sync_save.*expected true or false"):
        parse_request({"cachefuse": {"chunks": [[0, 4]], "sync_save": value}}, list(range(8)), SYNC_SAVE_CFG)
    request = parse_request({"cachefuse": {"chunks": [[0, 4]], "sync_save": True}}, list(range(8)), SYNC_SAVE_CFG)
    assert request.sync_save and not parse_request({"cachefuse": {"chunks": [[0, 4]]}}, list(range(8)),
                                                   SYNC_SAVE_CFG).sync_save


def test_sync_save_is_refused_unless_the_config_allows_it():
    """It writes the request's holes before the step's forward, stalling the whole batch: a server's API
    clients may not ask for it (the request runs as plain vLLM, naming the field and the setting).
    Negative control: an engine with allow_sync_save (offline precompute's) accepts it."""
    fields = {"chunks": [[0, 4]], "sync_save": True}
    with pytest.raises(RequestError, match="allow_sync_save") as refused:
        parse_request({"cachefuse": fields}, list(range(8)), CacheFuseConfig())
    assert refused.value.field == "cachefuse.sync_save"
    assert parse_request({"cachefuse": fields}, list(range(8)), SYNC_SAVE_CFG).sync_save
    unasked = parse_request({"cachefuse": {**fields, "sync_save": False}}, list(range(8)), CacheFuseConfig())
    assert unasked.sync_save is False  # false asks for nothing: accepted everywhere


@pytest.mark.parametrize("value", [1, "yes", None, [True]])
def test_store_variant_must_be_a_boolean(value):
    with pytest.raises(RequestError, match=r"cachefuse\.store_variant"):
        parse_request({"cachefuse": {"chunks": [[2, 4]], "store_variant": value}}, list(range(8)), CacheFuseConfig())
    request = parse_request({"cachefuse": {"chunks": [[0, 2], [2, 4], [4, 6]], "store_variant": True}},
                            list(range(8)), CacheFuseConfig())
    assert request.store_variant and not parse_request({"cachefuse": {"chunks": [[2, 4]]}}, list(range(8)),
                                                       CacheFuseConfig()).store_variant


def test_store_variant_needs_a_chunk_after_the_system_chunk():
    with pytest.raises(RequestError, match=r"cachefuse\.store_variant.*system chunk"):
        parse_request({"cachefuse": {"chunks": [[0, 4]], "store_variant": True}}, list(range(8)), CacheFuseConfig())

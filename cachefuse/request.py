"""What a request asks of cachefuse: `kv_transfer_params["cachefuse"]`, parsed and validated.

Imports only the standard library and cachefuse.{chunks, config, errors}; no vllm, no torch. Every
malformed field raises RequestError naming it (e.g. "cachefuse.chunks[2]"), and a request beyond the
configured bounds RequestLimitError, so the connector can run the request as plain vLLM and say why in
its response. Nothing else ever leaves `parse_request`, and no error carries more than an excerpt of
what the client sent.

Accepted shape (docs/architecture.md, Definitions):

    {"cachefuse": {"chunks": [[start, end], ...]}}          token offsets, sorted, non-overlapping
    {"cachefuse": {"chunk_texts": ["...", ...]}}            matched as standalone-tokenized subsequences
    optional: "selector", "recompute_ratio", "selected_rows" (debug, when allowed),
              "sync_save" (true: the response waits until this request's holes are written; offline
              precompute, when allow_sync_save),
              "store_variant" (true: the last declared chunk is computed in full and stored as the
              variant for the chunks before it, the others loaded; offline neighbour fusion)
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cachefuse.chunks import (  # PARAMS_KEY: exported here too
    PARAMS_KEY,
    Segment,
    chunks_from_texts,
    segment_prompt,
)
from cachefuse.config import CacheFuseConfig
from cachefuse.config_checks import SELECTORS
from cachefuse.errors import RequestError, RequestLimitError

KNOWN_FIELDS = ("chunks", "chunk_texts", "selector", "recompute_ratio", "selected_rows", "sync_save",
                "store_variant")

_EXCERPT = reprlib.Repr()
_EXCERPT.maxlevel, _EXCERPT.maxstring, _EXCERPT.maxother = 3, 40, 40
_EXCERPT.maxlist = _EXCERPT.maxtuple = _EXCERPT.maxdict = _EXCERPT.maxset = 4


@dataclass(frozen=True)
class FusionRequest:
    """A validated fusion request: declared chunks, the prompt's segments, and the per-request choices."""

    segments: tuple[Segment, ...]
    """The tiling of the prompt's [0, N) (`chunks.segment_prompt`): each declared chunk and the computed
    ranges between them, computed once here so neither half segments the prompt again."""
    selector: str
    recompute_ratio: float
    selected_rows: tuple[int, ...] | None = None
    sync_save: bool = False
    """Write this request's holes before its response (not behind it): offline precompute, which reports
    each chunk stored or failed. Costs the write on the engine's step, as `save_queue_bytes: 0` does, so
    only an engine with `allow_sync_save` accepts it."""
    store_variant: bool = False
    """Compute the last declared chunk in full, whatever is stored, so it is saved as the variant for the
    non-system chunks before it (FusionRAG's neighbour fusion through vLLM); no other chunk is admitted.
    It stores no more than a new chunk's hole would: one chunk per request, within the store's caps. Only an
    engine that allows offline jobs (`allow_sync_save`) saves it marked neighbour-fused (the variant
    `default_variant: fused` loads wherever the chunk is not first)."""

    @property
    def chunks(self) -> tuple[tuple[int, int], ...]:
        """The declared chunks' `[start, end)`, in order (read from `segments`, the one record of them)."""
        return tuple((s.start, s.end) for s in self.segments if s.is_chunk)


def wants_fusion(params: dict[str, Any] | None, config: CacheFuseConfig) -> bool:
    """True when the request opts in (or the separator fallback is on)."""
    if isinstance(params, dict) and PARAMS_KEY in params:
        return True
    return config.separator_token_id is not None


def parse_request(params: dict[str, Any] | None, prompt_ids: Sequence[int], config: CacheFuseConfig,
                  tokenize: Callable[[str], list[int]] | None = None) -> FusionRequest | None:
    """Validates a request's parameters against its prompt; raises RequestError on any bad field.

    Nothing else leaves it for any input: whatever a client sends (wrong types, non-string keys, deep
    nesting, lone surrogates, megabytes of text), the caller gets a RequestError naming the field, with
    a bounded excerpt of the value (`excerpt`), never the value itself. Requests beyond the configured
    bounds (`max_chunks_per_request`, `min_chunk_tokens`, `max_chunk_text_bytes`) raise
    RequestLimitError, checked before the costly step each bounds.

    Returns None for a request that does not ask for fusion (plain vLLM, nothing to report).
    """
    raw = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    if raw is None:
        if isinstance(params, dict) and PARAMS_KEY in params:
            raise RequestError(PARAMS_KEY, 'null; expected an object such as {"chunks": [[start, end], ...]}')
        return _from_separators(prompt_ids, config)
    if not isinstance(raw, dict):
        raise RequestError(PARAMS_KEY, f"expected an object, got {type(raw).__name__}")
    unknown = [key for key in raw if not (isinstance(key, str) and key in KNOWN_FIELDS)]
    if unknown:
        raise RequestError(f"{PARAMS_KEY}.{_key_name(unknown[0])}",
                           f"unknown field; expected some of {', '.join(KNOWN_FIELDS)}")
    if ("chunks" in raw) == ("chunk_texts" in raw):
        raise RequestError(PARAMS_KEY, "expected exactly one of 'chunks' (token offsets) or 'chunk_texts'")
    segments, spans = _declared_segments(raw, prompt_ids, tokenize, config)
    selector = raw.get("selector", config.selector)
    if not isinstance(selector, str) or selector not in SELECTORS:
        raise RequestError(f"{PARAMS_KEY}.selector", f"{excerpt(selector)}; expected one of {', '.join(SELECTORS)}")
    ratio = raw.get("recompute_ratio", config.recompute_ratio)
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 <= ratio <= 1.0:
        raise RequestError(f"{PARAMS_KEY}.recompute_ratio", f"{excerpt(ratio)}; expected a number in 0.0..1.0")
    sync_save = _sync_save(raw, config)
    store_variant = raw.get("store_variant", False)
    if not isinstance(store_variant, bool):
        raise RequestError(f"{PARAMS_KEY}.store_variant", f"{excerpt(store_variant)}; expected true or false")
    if store_variant and spans[-1][0] == 0:
        raise RequestError(f"{PARAMS_KEY}.store_variant", "the last declared chunk starts the prompt (the system "
                                                          "chunk has no variants); declare the chunk to store last")
    return FusionRequest(segments=tuple(segments), selector=selector, recompute_ratio=float(ratio),
                         selected_rows=_selected_rows(raw, len(prompt_ids), config), sync_save=sync_save,
                         store_variant=store_variant)


def excerpt(value: Any) -> str:
    """A bounded repr of a client's value for an error message: at most a few dozen characters and three
    levels deep, whatever its size or nesting (a 4 MB string, a list nested 1,000 deep)."""
    return _EXCERPT.repr(value)


def _key_name(key: Any) -> str:
    return key if isinstance(key, str) and len(key) <= 40 and key.isprintable() else excerpt(key)


def _declared_segments(raw: dict[str, Any], prompt_ids: Sequence[int], tokenize: Callable[[str], list[int]] | None,
                       config: CacheFuseConfig) -> tuple[list[Segment], tuple[tuple[int, int], ...]]:
    """The prompt's segments (computed here, once) and the declared chunks' spans, from `chunks` or
    `chunk_texts`; raises RequestError / RequestLimitError naming the entry."""
    source = "chunks" if "chunks" in raw else "chunk_texts"
    if source == "chunks":
        chunks = raw["chunks"]
        _check_count(chunks, source, config)
    else:
        chunks = _chunks_from_texts(raw["chunk_texts"], prompt_ids, tokenize, config)
    # segment_prompt validates the offsets strictly and names "cachefuse.chunks[i]".
    segments = segment_prompt(len(prompt_ids), chunks)
    spans = tuple((s.start, s.end) for s in segments if s.is_chunk)
    if not spans:
        raise RequestError(f"{PARAMS_KEY}.{source}", "empty: declare at least one chunk, or leave out "
                                                     f"'{PARAMS_KEY}' to run as plain vLLM")
    if spans[-1][1] >= len(prompt_ids):
        # The hit must stop one token short of the prompt end: vLLM computes the last token.
        raise RequestError(f"{PARAMS_KEY}.{source}[{len(spans) - 1}]",
                           f"ends at the prompt end ({len(prompt_ids)}); leave at least the last token outside")
    for i, (start, end) in enumerate(spans):
        if end - start < config.min_chunk_tokens:
            raise RequestLimitError(f"{PARAMS_KEY}.{source}[{i}]",
                                    f"{end - start} token(s); below min_chunk_tokens={config.min_chunk_tokens}")
    return segments, spans


def _check_count(chunks: Any, source: str, config: CacheFuseConfig) -> None:
    if isinstance(chunks, list | tuple) and len(chunks) > config.max_chunks_per_request:
        raise RequestLimitError(f"{PARAMS_KEY}.{source}", f"{len(chunks)} chunks; above "
                                                          f"max_chunks_per_request={config.max_chunks_per_request}")


def _chunks_from_texts(texts: Any, prompt_ids: Sequence[int], tokenize: Callable[[str], list[int]] | None,
                       config: CacheFuseConfig) -> list[tuple[int, int]]:
    """Every text checked and the byte budget enforced before the first is tokenized."""
    field = f"{PARAMS_KEY}.chunk_texts"
    if not isinstance(texts, list) or not texts:
        raise RequestError(field, "expected a non-empty list of strings")
    _check_count(texts, "chunk_texts", config)
    if tokenize is None:
        raise RequestError(field, "this engine has no tokenizer for chunk_texts; send token offsets in 'chunks'")
    num_bytes = 0
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text:
            raise RequestError(f"{field}[{i}]", f"{excerpt(text)}; expected a non-empty string")
        try:
            num_bytes += len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise RequestError(f"{field}[{i}]", "not valid Unicode text (it holds a lone surrogate)") from None
        if num_bytes > config.max_chunk_text_bytes:
            raise RequestLimitError(field, f"more than max_chunk_text_bytes={config.max_chunk_text_bytes} "
                                           "bytes of UTF-8 text")
    chunk_ids = []
    for i, text in enumerate(texts):
        try:
            ids = tokenize(text)
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure is this field's, never the engine's
            raise RequestError(f"{field}[{i}]", f"could not be tokenized ({type(exc).__name__})") from None
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise RequestError(f"{field}[{i}]", "the tokenizer returned something other than token ids")
        chunk_ids.append(ids)
    return chunks_from_texts(prompt_ids, chunk_ids)


def _selected_rows(raw: dict, num_tokens: int, config: CacheFuseConfig) -> tuple[int, ...] | None:
    if "selected_rows" not in raw:
        return None
    field = f"{PARAMS_KEY}.selected_rows"
    if not config.allow_debug_overrides:
        raise RequestError(field, "a debug override; enable allow_debug_overrides in the config to use it")
    rows = raw["selected_rows"]
    if not isinstance(rows, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows):
        raise RequestError(field, "expected a list of token offsets")
    if any(not 0 <= r < num_tokens for r in rows):
        raise RequestError(field, f"offsets must lie in 0..{num_tokens - 1}")
    return tuple(sorted(set(rows)))


def _sync_save(raw: dict, config: CacheFuseConfig) -> bool:
    """`sync_save`, refused unless the engine allows it: the holes are written before the step's forward,
    so one client asking for it would stall every request in the batch."""
    field = f"{PARAMS_KEY}.sync_save"
    sync_save = raw.get("sync_save", False)
    if not isinstance(sync_save, bool):
        raise RequestError(field, f"{excerpt(sync_save)}; expected true or false")
    if sync_save and not config.allow_sync_save:
        raise RequestError(field, "for offline jobs (the batch waits on this request's writes); enable "
                                  "allow_sync_save in the config to use it")
    return sync_save


def _from_separators(prompt_ids: Sequence[int], config: CacheFuseConfig) -> FusionRequest | None:
    """Separator fallback: [system] SEP [chunk] SEP ... SEP [question]; separators are computed."""
    sep = config.separator_token_id
    cuts = [i for i, t in enumerate(prompt_ids) if t == sep] if sep is not None else []
    if not cuts:
        return None
    bounds = [-1, *cuts]
    spans = tuple((a + 1, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a + 1)
    if len(spans) > config.max_chunks_per_request:
        raise RequestLimitError(PARAMS_KEY, f"{len(spans)} chunks between separators; above "
                                            f"max_chunks_per_request={config.max_chunks_per_request}")
    spans = tuple((a, b) for a, b in spans if b - a >= config.min_chunk_tokens)  # short pieces: computed
    if not spans:
        return None
    return FusionRequest(segments=tuple(segment_prompt(len(prompt_ids), spans)),
                         selector=config.selector, recompute_ratio=config.recompute_ratio)

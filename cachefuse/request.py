"""What a request asks of cachefuse: `kv_transfer_params["cachefuse"]`, parsed and validated.

Imports only cachefuse.{chunks, config, errors}; no vllm, no torch. Every malformed field raises
RequestError naming it (e.g. "cachefuse.chunks[2]"), so the connector can run the request as plain
vLLM and say why in its response.

Accepted shape (docs/architecture.md, Definitions):

    {"cachefuse": {"chunks": [[start, end], ...]}}          token offsets, sorted, non-overlapping
    {"cachefuse": {"chunk_texts": ["...", ...]}}            matched as standalone-tokenized subsequences
    optional: "selector", "recompute_ratio", "selected_rows" (debug, when allowed)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cachefuse.chunks import chunks_from_texts, segment_prompt
from cachefuse.config import SELECTORS, CacheFuseConfig
from cachefuse.errors import RequestError

PARAMS_KEY = "cachefuse"
KNOWN_FIELDS = ("chunks", "chunk_texts", "selector", "recompute_ratio", "selected_rows")


@dataclass(frozen=True)
class FusionRequest:
    """A validated fusion request: declared chunks and the per-request choices."""

    chunks: tuple[tuple[int, int], ...]
    selector: str
    recompute_ratio: float
    selected_rows: tuple[int, ...] | None = None


def wants_fusion(params: dict[str, Any] | None, config: CacheFuseConfig) -> bool:
    """True when the request opts in (or the separator fallback is on)."""
    if isinstance(params, dict) and PARAMS_KEY in params:
        return True
    return config.separator_token_id is not None


def parse_request(params: dict[str, Any] | None, prompt_ids: Sequence[int], config: CacheFuseConfig,
                  tokenize: Callable[[str], list[int]] | None = None) -> FusionRequest | None:
    """Validates a request's parameters against its prompt; raises RequestError on any bad field.

    Returns None for a request that does not ask for fusion (plain vLLM, nothing to report).
    """
    raw = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    if raw is None:
        return _from_separators(prompt_ids, config)
    if not isinstance(raw, dict):
        raise RequestError(PARAMS_KEY, f"expected an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(KNOWN_FIELDS))
    if unknown:
        raise RequestError(f"{PARAMS_KEY}.{unknown[0]}", f"unknown field; expected some of {', '.join(KNOWN_FIELDS)}")
    if ("chunks" in raw) == ("chunk_texts" in raw):
        raise RequestError(PARAMS_KEY, "expected exactly one of 'chunks' (token offsets) or 'chunk_texts'")
    if "chunks" in raw:
        chunks = raw["chunks"]
    else:
        chunks = _chunks_from_texts(raw["chunk_texts"], prompt_ids, tokenize)
    # segment_prompt validates the offsets strictly and names "cachefuse.chunks[i]".
    segments = segment_prompt(len(prompt_ids), chunks)
    spans = tuple((s.start, s.end) for s in segments if s.is_chunk)
    if spans and spans[-1][1] >= len(prompt_ids):
        # The hit must stop one token short of the prompt end: vLLM computes the last token.
        raise RequestError(f"{PARAMS_KEY}.chunks[{len(spans) - 1}]",
                           f"ends at the prompt end ({len(prompt_ids)}); leave at least the last token outside")
    selector = raw.get("selector", config.selector)
    if selector not in SELECTORS:
        raise RequestError(f"{PARAMS_KEY}.selector", f"{selector!r}; expected one of {', '.join(SELECTORS)}")
    ratio = raw.get("recompute_ratio", config.recompute_ratio)
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 <= ratio <= 1.0:
        raise RequestError(f"{PARAMS_KEY}.recompute_ratio", f"{ratio!r}; expected a number in 0.0..1.0")
    return FusionRequest(spans, selector, float(ratio), _selected_rows(raw, len(prompt_ids), config))


def _chunks_from_texts(texts: Any, prompt_ids: Sequence[int],
                       tokenize: Callable[[str], list[int]] | None) -> list[tuple[int, int]]:
    field = f"{PARAMS_KEY}.chunk_texts"
    if not isinstance(texts, list) or not texts:
        raise RequestError(field, "expected a non-empty list of strings")
    if tokenize is None:
        raise RequestError(field, "this engine has no tokenizer for chunk_texts; send token offsets in 'chunks'")
    chunk_ids = []
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text:
            raise RequestError(f"{field}[{i}]", "expected a non-empty string")
        chunk_ids.append(tokenize(text))
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


def _from_separators(prompt_ids: Sequence[int], config: CacheFuseConfig) -> FusionRequest | None:
    """Separator fallback: [system] SEP [chunk] SEP ... SEP [question]; separators are computed."""
    sep = config.separator_token_id
    cuts = [i for i, t in enumerate(prompt_ids) if t == sep] if sep is not None else []
    if not cuts:
        return None
    bounds = [-1, *cuts]
    spans = tuple((a + 1, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a + 1)
    return FusionRequest(spans, config.selector, config.recompute_ratio)

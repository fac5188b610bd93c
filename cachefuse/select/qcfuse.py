"""qcfuse: QCFuse's query-aware selection over a compressed view (anchors, critical layers).

The question is probed (cachefuse.fusion.probe) against the system chunk and each loaded chunk's *anchors*
only, up to the deepest critical layer; at each critical layer its attention to every context token
(the full context's keys) scores the token; one global top-k at the recompute ratio is recomputed
through every layer. The ablations are configurations of this one class (docs/selectors.md):

| config (qcfuse_view, qcfuse_layers)  | the probe attends over    | score layers              |
|--------------------------------------|---------------------------|---------------------------|
| anchors, critical (default)          | system + anchors          | qcfuse_critical_layers    |
| anchors, last / all                  | system + anchors          | the last / every layer    |
| question_only, last (QCLast)         | system only (query-only)  | the last layer            |
| full, all (QCAll, ProphetKV)         | every loaded row          | every layer               |

QCLast and QCAll are the QCFuse demo's baselines, its emulations of FusionRAG (a query-only probe read
at the final layer) and ProphetKV (the question over the whole loaded context, every layer); the
reference code runs them as anchor ratios 0 and 1.

Anchors of a chunk: its first `sink_tokens` tokens, then the highest-ranked others, ceil(r_a x |c|) in
all (QCFuse Eq. 14). Ranking "key_norm": the mean L2 norm of the token's stored (RoPE-free) keys over
layers and KV heads, a pure function of the stored entry. An entry may carry anchors chosen otherwise
in its metadata (`ANCHORS_META`, written offline by cachefuse.offline.anchors: key-norm, attention or
KVzip ranking); without them the key-norm anchors are derived from the loaded entry.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

import torch

from cachefuse.chunks import Segment
from cachefuse.select.base import ProbeSelector, ProbeSpec
from cachefuse.store.base import ChunkKV

RANKINGS = ("key_norm", "attention", "kvzip")
"""How a chunk's tokens are ranked for anchors (cachefuse.offline.anchors says how each is computed)."""

MODEL_RANKINGS = ("attention", "kvzip")
"""Rankings whose scores come from running the model offline (cachefuse.offline.anchors), not the entry."""

VIEWS = ("anchors", "full", "question_only")
"""What the probe's question attends over besides itself (config `qcfuse_view`)."""

ANCHORS_META = "qcfuse_anchors"
"""Entry metadata key: JSON {"ranking", "ratio", "sink_tokens", "offsets"} of the chunk's anchors."""


def anchor_count(num_tokens: int, ratio: float) -> int:
    """ceil(r_a x |c|), at least 1 for a non-empty chunk (a guard against 0.1 * 30 = 3.0000000000000004)."""
    return min(num_tokens, max(1 if num_tokens else 0, math.ceil(ratio * num_tokens - 1e-9)))


def rank_anchors(token_scores: torch.Tensor, ratio: float, sink_tokens: int) -> torch.Tensor:
    """Sorted offsets: the first `sink_tokens`, then the highest `token_scores`, ceil(ratio x n) in all."""
    num_tokens = int(token_scores.numel())
    count = anchor_count(num_tokens, ratio)
    sinks = min(sink_tokens, count)
    rest = torch.topk(token_scores[sinks:].float(), count - sinks, sorted=False).indices + sinks
    return torch.cat([torch.arange(sinks, device=rest.device), rest]).sort().values


def key_norm_scores(k_nope: Sequence[torch.Tensor]) -> torch.Tensor:
    """[num_tokens] fp32: each token's key L2 norm, averaged over layers and KV heads."""
    return torch.stack([k.float().norm(dim=-1).mean(dim=1) for k in k_nope]).mean(dim=0)


def anchors_from_meta(meta: Mapping[str, str], num_tokens: int, ratio: float, sink_tokens: int) -> torch.Tensor | None:
    """The stored anchors when they were chosen with this ratio and sink count and fit the chunk; else None."""
    raw = meta.get(ANCHORS_META)
    if raw is None:
        return None
    try:
        stored = json.loads(raw)
        offsets = torch.tensor(sorted({int(x) for x in stored["offsets"]}), dtype=torch.int64, device="cpu")
        fits = (float(stored["ratio"]) == ratio and int(stored["sink_tokens"]) == sink_tokens
                and offsets.numel() == anchor_count(num_tokens, ratio)
                and (offsets.numel() == 0 or 0 <= int(offsets[0]) and int(offsets[-1]) < num_tokens))
    except (ValueError, TypeError, KeyError, OverflowError):
        return None  # a damaged row is a miss: the key-norm anchors are derived instead
    return offsets if fits else None


def anchors_meta(offsets: torch.Tensor, ranking: str, ratio: float, sink_tokens: int) -> str:
    return json.dumps({"ranking": ranking, "ratio": ratio, "sink_tokens": sink_tokens,
                       "offsets": [int(x) for x in offsets]})


def choose_anchors(entry: ChunkKV, ranking: str, ratio: float, sink_tokens: int,
                   model_scores: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted chunk-local offsets of the anchors (CPU int64); a MODEL_RANKINGS ranking needs `model_scores`,
    one per token (cachefuse.offline.anchors: received_attention, reconstruction_attention)."""
    if ranking == "key_norm":
        scores = key_norm_scores(entry.k_nope).cpu()
    elif ranking in MODEL_RANKINGS:
        if model_scores is None or model_scores.numel() != entry.num_tokens:
            raise ValueError(f"ranking {ranking!r} needs {entry.num_tokens} scores from the model "
                             "(cachefuse.offline.anchors)")
        scores = model_scores
    else:
        raise ValueError(f"anchor ranking {ranking!r}: expected one of {', '.join(RANKINGS)}")
    return rank_anchors(scores, ratio, sink_tokens).cpu()


def with_anchors(entry: ChunkKV, offsets: torch.Tensor, ranking: str, ratio: float, sink_tokens: int) -> ChunkKV:
    """The same tensors (not copied: stored entries are read-only) with the anchors in the metadata."""
    meta = dict(entry.meta)
    meta[ANCHORS_META] = anchors_meta(offsets, ranking, ratio, sink_tokens)
    return ChunkKV(entry.k_nope, entry.v, meta)


def critical_layer_indices(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Sorted distinct layers, negatives counted from the end (-1: the last layer)."""
    resolved = sorted({layer + num_layers if layer < 0 else layer for layer in layers})
    if not resolved or resolved[0] < 0 or resolved[-1] >= num_layers:
        raise ValueError(f"qcfuse_critical_layers={tuple(layers)!r}: the model has {num_layers} layers "
                         f"(0..{num_layers - 1}, or -1..-{num_layers} from the end)")
    return tuple(resolved)


def default_critical_layers(num_layers: int) -> tuple[int, ...]:
    """Three middle-deep layers around 60% of the depth, for a model not profiled yet
    (`cachefuse profile-layers`); QCFuse's profiles put them there (e.g. 19-21 of Qwen3-8B's 36)."""
    centre = round(0.6 * (num_layers - 1))
    return tuple(sorted({min(num_layers - 1, max(0, centre + d)) for d in (-1, 0, 1)}))


class QCFuseSelector(ProbeSelector):
    name = "qcfuse"

    def __init__(self, anchor_ratio: float = 0.1, sink_tokens: int = 1, layers: str = "critical",
                 critical_layers: Sequence[int] | None = None, view: str = "anchors") -> None:
        assert layers in ("critical", "last", "all") and view in VIEWS, (layers, view)
        self.anchor_ratio, self.sink_tokens = anchor_ratio, sink_tokens
        self.layers, self.critical_layers, self.view = layers, critical_layers, view

    def score_layers(self, num_layers: int) -> tuple[int, ...]:
        if self.layers == "last":
            return (num_layers - 1,)
        if self.layers == "all":
            return tuple(range(num_layers))
        if self.critical_layers is None:
            return default_critical_layers(num_layers)
        return critical_layer_indices(self.critical_layers, num_layers)

    def probe_spec(self, num_layers: int) -> ProbeSpec:
        return ProbeSpec(self.score_layers(num_layers), anchors_only=self.view == "anchors",
                         question_only=self.view == "question_only")

    def probe_anchor_partials(self, segment: Segment, k_nope: Sequence[torch.Tensor]) -> torch.Tensor:
        return key_norm_scores(k_nope)  # this rank's KV heads: the ranks sum them, so all rank alike

    def probe_anchors(self, segment: Segment, k_nope: Sequence[torch.Tensor], meta: Mapping[str, str],
                      summed: torch.Tensor | None = None) -> torch.Tensor:
        stored = anchors_from_meta(meta, segment.length, self.anchor_ratio, self.sink_tokens)
        if stored is not None:
            return stored
        return rank_anchors(key_norm_scores(k_nope) if summed is None else summed, self.anchor_ratio, self.sink_tokens)

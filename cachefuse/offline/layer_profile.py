"""QCFuse's critical layers, profiled once per model (`cachefuse profile-layers`).

QCFuse scores the context by the question's attention at a few "critical" layers, and which layers
those are depends on the model, so it is measured rather than guessed. On prompts whose answer sits in a
known place (the QA set's documents, where the answer's words occur), each layer l alone scores every
cached context token with the question probe (the `qcfuse` selector's own probe: the same anchors, the
same view), and R(l) is its Recall@r: the share of the answer's tokens among the top r of the
candidates (r = 10%, the paper's budget). Layers are ranked by R(l); the top-k set L_k, scored by the
sum of its layers' scores, is measured for k = 1..K (the paper keeps k = 3, where its curve flattens);
the critical set is L_k for the chosen k.

The profile is stored as JSON under `<store>/profiles/<model fingerprint>.json`, beside the chunks it
serves; how it is stored and read at serving time (`with_profiled_layers`) is
cachefuse.metadata.layer_profiles, which serving code imports: this module is an offline job.

Imports torch, tqdm, cachefuse.select and cachefuse.metadata.layer_profiles; never vllm.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from cachefuse.metadata.layer_profiles import LayerProfile
from cachefuse.select.base import ProbeSpec, SelectionContext
from cachefuse.select.qcfuse import QCFuseSelector

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class ProfileItem:
    """One labelled prompt: its ids, declared chunks (the system prompt first, at offset 0) and the rows
    of the answer's evidence (absolute positions inside declared non-system chunks)."""

    token_ids: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]
    evidence_rows: tuple[int, ...]


def recall_at(scores, candidate_rows, evidence_rows, ratio: float) -> float | None:
    """|top ceil(ratio * candidates) by score, ∩ evidence| / |evidence|; None when no evidence is a candidate.
    Ties are broken by row (the earlier row first), so a flat score is not a lucky one."""
    evidence = torch.as_tensor(sorted(evidence_rows), dtype=torch.int64)
    is_evidence = torch.isin(candidate_rows, evidence)
    total = int(is_evidence.sum())
    if total == 0:
        return None
    count = min(candidate_rows.numel(), math.ceil(ratio * candidate_rows.numel()))
    order = sorted(range(candidate_rows.numel()), key=lambda i: (-float(scores[i]), int(candidate_rows[i])))
    return float(is_evidence[order[:count]].sum()) / total


def profile_layers(engine, items: Iterable[ProfileItem], *, ratio: float = 0.1, num_critical: int = 3,
                   view: str = "anchors", max_k: int = 10, progress: bool = False) -> LayerProfile:
    """Profiles `engine`'s model on `items` (see the module doc). The engine's store receives each
    prompt's chunks (base variants after its system prompt, as deployed); nothing else is written.

    Raises:
        ValueError: no item has evidence inside a declared chunk.
    """
    num_layers = engine.adapter.shape.num_layers
    selector = _ProfilingSelector(engine.config, view)
    per_layer: list[list[float]] = [[] for _ in range(num_layers)]
    runs: list[tuple[dict[int, torch.Tensor], torch.Tensor, tuple[int, ...]]] = []
    for item in tqdm(list(items), desc="profile-layers", unit="prompt", disable=not progress):
        system_start, system_end = item.chunks[0]
        if system_start != 0:
            raise ValueError(f"a profile item's first declared chunk is its system prompt, at offset 0: "
                             f"got {item.chunks[0]}")
        system = list(item.token_ids[:system_end])
        engine.precompute([system])
        engine.precompute([list(item.token_ids[s:e]) for s, e in item.chunks[1:]], prefix_ids=system)
        engine.prefill(list(item.token_ids), list(item.chunks), selector=selector, ratio=0.0, save_holes=False)
        layer_scores, candidates = selector.captured
        if recall_at(layer_scores[0], candidates, item.evidence_rows, ratio) is None:
            continue  # the answer is not in a cached chunk (or every chunk missed): nothing to measure
        runs.append((layer_scores, candidates, item.evidence_rows))
        for layer in range(num_layers):
            per_layer[layer].append(recall_at(layer_scores[layer], candidates, item.evidence_rows, ratio))
    if not runs:
        raise ValueError("no profile item has answer evidence inside a declared chunk")
    recall = tuple(sum(values) / len(values) for values in per_layer)
    ranked = sorted(range(num_layers), key=lambda layer: (-recall[layer], layer))
    top_k_recall = []
    for k in range(1, min(max_k, num_layers) + 1):
        layers = ranked[:k]
        values = [recall_at(sum(scores[layer] for layer in layers), candidates, evidence, ratio)
                  for scores, candidates, evidence in runs]
        top_k_recall.append(sum(values) / len(values))
    critical = tuple(sorted(ranked[:min(num_critical, num_layers)]))
    return LayerProfile(engine.key_context.model_fingerprint, num_layers, ratio, view, engine.config.qcfuse_anchor_ratio,
                        len(runs), recall, tuple(top_k_recall), critical)


class _ProfilingSelector(QCFuseSelector):
    """The qcfuse selector scoring at every layer, each layer's scores kept apart and captured per prompt."""

    name = "qcfuse-profile"

    def __init__(self, config, view: str) -> None:
        super().__init__(anchor_ratio=config.qcfuse_anchor_ratio, sink_tokens=config.qcfuse_sink_tokens,
                         layers="all", view=view)
        self.captured: tuple[dict[int, torch.Tensor], torch.Tensor] | None = None

    def probe_spec(self, num_layers: int) -> ProbeSpec:
        return ProbeSpec(tuple(range(num_layers)), anchors_only=self.view == "anchors", per_layer=True)

    def initial_rows(self, ctx: SelectionContext) -> torch.Tensor:
        assert ctx.probe_layer_scores is not None, "the fusor dropped the per-layer probe scores"
        self.captured = (dict(ctx.probe_layer_scores), ctx.candidate_rows.clone())
        return super().initial_rows(ctx)


def evidence_item(token_ids: Sequence[int], chunks: Sequence[tuple[int, int]],
                  evidence_rows: Iterable[int]) -> ProfileItem:
    """A ProfileItem with evidence rows kept only where they fall inside a declared non-system chunk."""
    inside = [(s, e) for s, e in chunks[1:]]
    rows = tuple(sorted({r for r in evidence_rows if any(s <= r < e for s, e in inside)}))
    return ProfileItem(tuple(int(t) for t in token_ids), tuple((int(s), int(e)) for s, e in chunks), rows)


def format_profile(profile: LayerProfile) -> str:
    """A few lines for a terminal: R(l) per layer with a bar, the top-k curve and the chosen set."""
    lines = [f"layer profile of {profile.fingerprint}: {profile.num_items} prompts, Recall@{profile.ratio:g} "
             f"of answer tokens, {profile.view} view (anchor ratio {profile.anchor_ratio:g})",
             "layer  recall"]
    for layer, value in enumerate(profile.recall):
        mark = "  *" if layer in profile.critical_layers else ""
        lines.append(f"{layer:5d}  {value:6.3f}  {'#' * round(40 * value)}{mark}")
    curve = ", ".join(f"k={k}: {value:.3f}" for k, value in enumerate(profile.top_k_recall, start=1))
    lines.append(f"top-k layers summed: {curve}")
    lines.append(f"critical layers: {', '.join(map(str, profile.critical_layers))}")
    return "\n".join(lines)


def plot_profile(profile: LayerProfile, path: str | Path) -> Path:
    """R(l) per layer (critical layers highlighted) and the top-k curve, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [3, 1]})
    colors = ["tab:orange" if layer in profile.critical_layers else "tab:blue" for layer in range(profile.num_layers)]
    left.bar(range(profile.num_layers), profile.recall, color=colors)
    left.set(xlabel="layer", ylabel=f"Recall@{profile.ratio:g} of answer tokens",
             title=f"{profile.num_items} prompts, {profile.view} view; critical (orange): "
                   f"{', '.join(map(str, profile.critical_layers))}")
    ks = range(1, len(profile.top_k_recall) + 1)
    right.plot(ks, profile.top_k_recall, marker="o")
    right.set(xlabel="k best layers summed", ylabel="recall", title="top-k")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""QCFuse's layer profiling (cachefuse/offline/layer_profile.py, `cachefuse profile-layers`). The stored
profiles (cachefuse/metadata/layer_profiles.py) are tested in tests/metadata/test_layer_profiles.py.

- Recall@r counts evidence among the top r of candidates, ties broken by row (a flat score earns no luck);
- the probe's per-layer scores sum to its total, and the profile's R(l) equals the recall of the
  `qcfuse` selector's own probe scored at layer l alone (an independent run per layer); the critical set
  is the top-k layers by R(l).

The QA set's answer evidence rows are tests/eval/test_qa_set.py's; the `profile-layers` command's
tests/cli/test_profile_layers.py's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cachefuse.chunks import segment_prompt
from cachefuse.offline.layer_profile import evidence_item, profile_layers, recall_at
from cachefuse.select.qcfuse import QCFuseSelector
from tests.helpers.fusion import make_case, make_engine

TOL = dict(atol=1e-5, rtol=1e-5)


def test_recall_counts_evidence_in_the_top_share_and_breaks_ties_by_row():
    rows = torch.arange(10, 20)
    scores = torch.tensor([0.0, 9.0, 0.0, 0.0, 8.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    assert recall_at(scores, rows, (11, 14), 0.2) == 1.0  # the top 2 of 10 are rows 11 and 14
    assert recall_at(scores, rows, (11, 19), 0.2) == 0.5
    assert recall_at(scores, rows, (11, 19), 0.21) == 1.0  # ceil(2.1) = 3 rows
    assert recall_at(torch.zeros(10), rows, (18, 19), 0.2) == 0.0  # flat: the first rows, not the evidence
    assert recall_at(scores, rows, (5, 30), 0.5) is None  # no evidence among the candidates


def test_the_probe_keeps_each_score_layers_share(adapter):
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=3)
    engine.precompute([case.system])
    engine.precompute(case.pieces, prefix_ids=case.system)
    selector = _capture(QCFuseSelector(layers="all"))
    engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.5, save_holes=False)
    layer_scores, total = selector.seen
    assert sorted(layer_scores) == list(range(adapter.shape.num_layers))
    torch.testing.assert_close(sum(layer_scores.values()), total, **TOL)


def _capture(selector):
    """Wraps `selector.initial_rows` to keep the probe's scores; asks for per-layer scores."""
    spec_of, rows_of = selector.probe_spec, selector.initial_rows

    def probe_spec(num_layers):
        return dataclasses.replace(spec_of(num_layers), per_layer=True)

    def initial_rows(ctx):
        selector.seen = (dict(ctx.probe_layer_scores), ctx.probe_scores.clone())
        return rows_of(ctx)

    selector.probe_spec, selector.initial_rows = probe_spec, initial_rows
    return selector


@pytest.mark.parametrize("view", ["anchors", "full"])
def test_profile_recall_equals_single_layer_probes_and_picks_the_best_layers(adapter, view):
    engine = make_engine(adapter)
    items, references = [], []
    for seed in (1, 2, 3):
        case = make_case(adapter.shape.vocab_size, seed=seed)
        a_start, a_end = case.chunks[1]
        c_start, _ = case.chunks[3]
        evidence = [a_start + 3, a_start + 4, c_start + 10, case.chunks[-1][1] + 2]  # the last: the question
        item = evidence_item(case.token_ids, case.chunks, evidence)
        assert item.evidence_rows == tuple(evidence[:3])  # only rows inside declared non-system chunks
        items.append(item)
        references.append((case, item, a_start))
    profile = profile_layers(engine, items, ratio=0.1, num_critical=2, view=view)
    num_layers = adapter.shape.num_layers
    assert profile.num_items == 3 and len(profile.recall) == num_layers and len(profile.top_k_recall) == min(10, num_layers)
    for layer in range(adapter.shape.num_layers):  # an independent probe per layer, the selector's own
        recalls = []
        for case, item, a_start in references:
            selector = _capture(QCFuseSelector(layers="critical", critical_layers=[layer], view=view))
            engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=0.0, save_holes=False)
            segments = segment_prompt(len(case.token_ids), case.chunks)
            # A, right after the system prompt it was precomputed after, is reused at its exact place: no candidate
            candidates = torch.tensor([r for s in segments[1:] if s.is_chunk and s.start != a_start
                                       for r in range(s.start, s.end)])
            recalls.append(recall_at(selector.seen[1], candidates, item.evidence_rows, 0.1))
        assert profile.recall[layer] == pytest.approx(sum(recalls) / len(recalls))
    assert profile.critical_layers == tuple(sorted(profile.ranked_layers[:2]))
    assert profile.top_k_recall[0] == pytest.approx(max(profile.recall))

"""The Selector and ProbeSelector contracts (cachefuse/select/base.py), table-driven over the selectors that
implement them: each selector's row estimate before the pass against the rows it picks, and the query-aware
selectors' (fusionrag, qcfuse: ProbeSelector.initial_rows) top-k of the probe's scores."""

import dataclasses

import pytest
import torch

from cachefuse.config import CacheFuseConfig
from cachefuse.select.base import PlannedChunk, RowEstimate, num_rows_for_ratio
from cachefuse.select.registry import make_selector
from tests.helpers.selection import SEGMENTS, make_ctx


def test_estimated_rows_match_the_rows_picked():
    """Each selector's estimate before the pass (Selector.estimate_rows) against what it picks."""
    chunks = [PlannedChunk(s.length) for s in SEGMENTS if s.is_chunk and not s.is_system]
    ctx = make_ctx(0.3)
    for name, config in (("cacheblend", CacheFuseConfig()), ("random", CacheFuseConfig()),
                         ("epic", CacheFuseConfig(epic_k=3))):
        estimate = make_selector(name, config).estimate_rows(chunks, 8)
        rows = num_rows_for_ratio(0.3, estimate.num_ratio_candidates) + estimate.num_planned_rows
        if name == "cacheblend":
            assert estimate == RowEstimate(0, 87) and rows == num_rows_for_ratio(0.3, 87)  # kept after its check
        else:
            assert rows == make_selector(name, config).initial_rows(ctx).numel()
    assert make_selector("full_reuse", CacheFuseConfig()).estimate_rows(chunks, 8) == RowEstimate(0, 0)
    ratio_epic = make_selector("epic", CacheFuseConfig()).estimate_rows(chunks, 8)
    # ceil per chunk (12 + 15) can exceed ceil over all (27): at most one row per chunk
    assert 0 <= make_selector("epic", CacheFuseConfig()).initial_rows(ctx).numel() - num_rows_for_ratio(
        0.3, ratio_epic.num_ratio_candidates) <= len(chunks)


@pytest.mark.parametrize("name", ["fusionrag", "qcfuse"])
@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.55])
def test_query_aware_selectors_recompute_the_rows_the_probe_scores_highest(name, ratio):
    """The probe's scores decide: the ceil(r x n) candidates it scored highest, no others (picking the
    lowest passed every other test)."""
    ctx = make_ctx(ratio)
    scores = torch.randperm(ctx.candidate_rows.numel(), generator=torch.Generator().manual_seed(5)).float()
    ctx = dataclasses.replace(ctx, probe_scores=scores)
    count = num_rows_for_ratio(ratio, ctx.candidate_rows.numel())
    expected = ctx.candidate_rows[scores.argsort(descending=True)[:count]].sort().values
    rows = make_selector(name, CacheFuseConfig()).initial_rows(ctx)
    assert torch.equal(rows, expected)
    lowest = ctx.candidate_rows[scores.argsort()[:count]].sort().values
    assert not torch.equal(rows, lowest)  # control: the other end of the ranking is another set

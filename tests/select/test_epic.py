"""epic (cachefuse/select/epic.py): the first tokens of each chunk, by ratio or a fixed count."""

import math

import pytest

from cachefuse.config import CacheFuseConfig
from cachefuse.select.registry import make_selector
from tests.helpers.selection import make_ctx


@pytest.mark.parametrize("ratio", [0.05, 0.15, 0.5])
def test_epic_picks_first_tokens_of_each_chunk(ratio):
    ctx = make_ctx(ratio)
    chosen = make_selector("epic", CacheFuseConfig()).initial_rows(ctx).tolist()
    expected = [r for s in ctx.candidate_segments for r in range(s.start, s.start + math.ceil(ratio * s.length))]
    assert chosen == expected
    fixed = make_selector("epic", CacheFuseConfig(epic_k=3)).initial_rows(ctx).tolist()
    assert fixed == [10, 11, 12, 47, 48, 49]

"""Blend passes batched across requests and split across steps (cachefuse.fusion.batch).

- every request of a batch gets the logits, K/V and rows it gets alone (float tolerance), under
  selectors with and without full layers, holes and prompts of different lengths;
- negative control: a varlen attention whose masks let a row see the keys of the request packed before
  it changes the later requests' outputs;
- a budget of rows splits passes across `advance` calls (engine steps) with the same results, each call
  computing at most the budget plus one layer; a burst is cut into cohorts that fit the budget;
- a pass cancelled mid-way releases its store pins and its loader thread; a failing pass fails alone,
  a failing batched op fails its whole group.
"""

from __future__ import annotations

import threading

import pytest
import torch

from cachefuse import attention
from cachefuse.chunks import segment_prompt
from cachefuse.config import CacheFuseConfig
from cachefuse.fusion.batch import (
    START_LAYER,
    Embed,
    LayerDone,
    OtherRankFailed,
    Output,
    PassBatch,
    Project,
    RankSum,
)
from cachefuse.fusion.engine import FusionEngine, RankGroup
from cachefuse.fusion.fusor import Fusor
from cachefuse.fusion.plan import FusePlan
from tests.helpers.fusion import make_case, make_engine, precompute_case

pytestmark = pytest.mark.tiny_model("llama", num_layers=4)
TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(scope="module")
def engine(adapter):
    """Three RAG prompts of different lengths; chunk B of each is a hole (computed, never stored)."""
    engine = make_engine(adapter, CacheFuseConfig(preload_depth=0))
    engine.cases = [make_case(adapter.shape.vocab_size, seed=seed, lengths=lengths)
                    for seed, lengths in ((1, (12, 23, 19, 31, 9)), (2, (12, 40, 11, 17, 6)),
                                          (3, (12, 15, 28, 22, 13)))]
    for case in engine.cases:
        case.system = engine.cases[0].system  # one system prompt, as a deployment has
        case.token_ids = case.system + case.pieces[0] + case.pieces[1] + case.pieces[2] + case.question
        precompute_case(engine, case)
    return engine


def plan(case, selector="cacheblend", ratio=0.3, **fields) -> FusePlan:
    return FusePlan(token_ids=case.token_ids, segments=segment_prompt(len(case.token_ids), case.chunks),
                    selector=selector, ratio=ratio, save_holes=False, **fields)


def alone(engine, plans):
    return [engine.fuse(p) for p in plans]


def batched(engine, plans, budget=None, estimates=None, charge=None):
    batch = PassBatch(engine.fusor.execute_ops, charge=charge)
    for i, p in enumerate(plans):
        batch.add(i, engine.fuse_steps(p), 0.0 if estimates is None else estimates[i])
    results, calls = {}, []
    while len(batch):
        advanced = batch.advance(budget)
        assert not advanced.failed, advanced.failed
        results.update(advanced.finished)
        calls.append(advanced)
        assert len(calls) < 100
    return [results[i] for i in range(len(plans))], calls


def assert_same(result, expected) -> None:
    torch.testing.assert_close(result.logits, expected.logits, **TOL)
    assert len(result.k) == len(expected.k)
    for ours, theirs in zip(result.k + result.v, expected.k + expected.v, strict=True):
        torch.testing.assert_close(ours, theirs, **TOL)
    for ours, theirs in zip(result.rows_per_layer, expected.rows_per_layer, strict=True):
        assert (ours is None) == (theirs is None)
        if ours is not None:
            assert torch.equal(ours, theirs)


@pytest.mark.parametrize("selector,ratio", [("cacheblend", 0.3), ("epic", 0.2), ("full_prefill", 1.0),
                                            ("full_reuse", 0.0), ("cacheblend", 1.0)])
def test_every_request_of_a_batch_gets_what_it_gets_alone(engine, selector, ratio):
    plans = [plan(case, selector, ratio) for case in engine.cases]
    results, calls = batched(engine, plans)
    assert len(calls) == 1  # no budget: every pass ends in one call
    for (result, _), (expected, _) in zip(results, alone(engine, plans), strict=True):
        assert_same(result, expected)
    assert set(calls[0].split.values()) == {(1, 3)}  # one step, three passes batched


def test_ratio_one_in_a_batch_equals_the_models_own_forward(engine, adapter):
    results, _ = batched(engine, [plan(case, "full_prefill", 1.0) for case in engine.cases])
    for (result, _), case in zip(results, engine.cases, strict=True):
        with torch.inference_mode():
            expected = adapter.model(torch.tensor([case.token_ids])).logits[0, -1].float()
        torch.testing.assert_close(result.logits, expected, atol=1e-4, rtol=1e-4)


def leaky_varlen(q, q_positions, cu_rows, k, v, cu_keys, scale, block_rows=64):
    """A varlen attention with the per-request boundary dropped: request b's row at position p sees every
    packed key up to cu_keys[b] + p, the earlier requests' keys included."""
    out = q.new_empty(q.shape)
    rows, keys = cu_rows.tolist(), cu_keys.tolist()
    for b in range(len(rows) - 1):
        out[rows[b]:rows[b + 1]] = attention.rows_attention(
            q[rows[b]:rows[b + 1]], q_positions[rows[b]:rows[b + 1]] + keys[b], k, v, scale, block_rows)
    return out


def test_negative_control_masks_that_see_another_requests_keys_change_its_output(engine):
    plans = [plan(case) for case in engine.cases]
    expected = alone(engine, plans)
    real = engine.fusor.varlen_attention_fn
    engine.fusor.varlen_attention_fn = leaky_varlen
    try:
        results, _ = batched(engine, plans)
    finally:
        engine.fusor.varlen_attention_fn = real
    assert_same(results[0][0], expected[0][0])  # the first request has nothing packed before it
    for (result, _), (want, _) in zip(results[1:], expected[1:], strict=True):
        assert (result.logits - want.logits).abs().max() > 1e-3


def test_a_budget_splits_passes_across_calls_with_the_same_results(engine, adapter):
    plans = [plan(case) for case in engine.cases]
    expected = alone(engine, plans)
    max_rows = max(len(case.token_ids) for case in engine.cases)
    budget = max_rows  # about one full layer of one request per call
    results, calls = batched(engine, plans, budget=budget)
    assert len(calls) > 2
    for (result, _), (want, _) in zip(results, expected, strict=True):
        assert_same(result, want)
    one_layer = sum(len(case.token_ids) for case in engine.cases)  # a layer of the whole batch, at most
    assert all(call.rows <= budget + one_layer for call in calls)
    assert sum(call.rows for call in calls) == sum(
        sum(len(case.token_ids) if rows is None else rows.numel() for rows in result.rows_per_layer)
        for (result, _), case in zip(results, engine.cases, strict=True))
    assert max(steps for steps, _ in calls[-1].split.values()) > 1


def layer_rows(result, num_tokens: int) -> list[int]:
    return [num_tokens if rows is None else rows.numel() for rows in result.rows_per_layer]


@pytest.mark.parametrize("selector", ["qcfuse", "fusionrag"])
def test_a_query_aware_pass_is_charged_its_probe_and_splits_inside_it(engine, selector):
    """The question probe's layers are blend work like the pass's own: charged to the budget, and points
    where a split pass pauses (before, a step ran a whole probe beyond its budget)."""
    plans = [plan(case, selector) for case in engine.cases]
    expected = alone(engine, plans)
    results, calls = batched(engine, plans, budget=1)  # every call stops at the first layer it finishes
    for (result, _), (want, _) in zip(results, expected, strict=True):
        assert_same(result, want)
    probes = [result.probe_rows * result.probe_layers for result, _ in results]
    assert all(probes)
    assert calls[0].rows == sum(result.probe_rows for result, _ in results)  # the probes' layer 0, batched
    assert sum(call.rows for call in calls) == sum(probes) + sum(
        sum(layer_rows(result, len(case.token_ids))) for (result, _), case in zip(results, engine.cases, strict=True))


def test_a_priced_batch_charges_each_layer_its_cost_and_stops_sooner(engine):
    plans = [plan(case) for case in engine.cases]
    budget = 2 * sum(len(case.token_ids) for case in engine.cases)  # two full layers of the batch, by rows
    _, by_rows = batched(engine, plans, budget=budget)
    results, priced = batched(engine, plans, budget=budget, charge=lambda done: 3.0 * done.rows + done.keys)
    assert len(priced) > len(by_rows)  # the same work, charged more: cut across more calls
    for (result, _), (want, _) in zip(results, alone(engine, plans), strict=True):
        assert_same(result, want)
    assert sum(call.rows for call in priced) == sum(
        3 * rows + len(case.token_ids) for (result, _), case in zip(results, engine.cases, strict=True)
        for rows in layer_rows(result, len(case.token_ids)))


def test_a_burst_is_cut_into_cohorts_that_fit_the_budget(engine):
    plans = [plan(case) for case in engine.cases]
    results, calls = batched(engine, plans, budget=100.0, estimates=[60.0, 30.0, 50.0])
    split = {}
    for call in calls:
        split.update(call.split)
    assert split[0][1] == split[1][1] == 2 and split[2][1] == 1  # 60 + 30 fit 100; 50 more would not
    for (result, _), (want, _) in zip(results, alone(engine, plans), strict=True):
        assert_same(result, want)


def test_a_cancelled_pass_releases_its_pins_and_loader_thread(adapter):
    engine = make_engine(adapter, CacheFuseConfig(preload_depth=2))
    case = make_case(adapter.shape.vocab_size, seed=5)
    precompute_case(engine, case)
    threads_before = threading.active_count()
    batch = PassBatch(engine.fusor.execute_ops)
    batch.add("a", engine.fuse_steps(plan(case)))
    batch.advance(budget_rows=1)  # one layer
    assert "a" in batch
    pinned = [key for key in engine.store.keys() if key in engine.store._pins]
    assert pinned  # mid-pass: its entries are pinned
    assert batch.cancel("a") and "a" not in batch
    assert not [key for key in engine.store.keys() if key in engine.store._pins]
    for thread in threading.enumerate():
        if thread.name.startswith("cachefuse"):
            thread.join(timeout=5)
    assert threading.active_count() <= threads_before


def test_a_failing_pass_fails_alone_and_a_failing_op_fails_its_group(engine):
    plans = [plan(case) for case in engine.cases]
    expected = alone(engine, plans)

    def broken_steps():
        yield Embed(torch.tensor([1, 2, 3]))
        raise RuntimeError("this request's own failure")

    batch = PassBatch(engine.fusor.execute_ops)
    batch.add(0, engine.fuse_steps(plans[0]))
    batch.add("broken", broken_steps())
    batch.add(2, engine.fuse_steps(plans[2]))
    advanced = batch.advance()
    assert set(advanced.failed) == {"broken"} and set(advanced.finished) == {0, 2}
    assert_same(advanced.finished[0][0], expected[0][0])
    assert_same(advanced.finished[2][0], expected[2][0])

    calls = []

    def failing_execute(ops):
        calls.append(type(ops[0]))
        if isinstance(ops[0], Project):
            raise RuntimeError("the batched matmul failed")
        return Fusor.execute_ops(engine.fusor, ops)

    batch = PassBatch(failing_execute)
    batch.add(0, engine.fuse_steps(plans[0]))
    batch.add(1, engine.fuse_steps(plans[1]))
    advanced = batch.advance()
    assert set(advanced.failed) == {0, 1} and not advanced.finished and not len(batch)


class _TwoRankGroup:
    """An all-reduce (sum) between two threads standing for two tensor-parallel ranks. Each call names
    what it is (the model's all-reduce or the ranks' agreement); calls that pair up mismatched, or a rank
    left waiting for a partner that never comes (`wait_s`: a deadlock fails, it does not hang), are
    recorded in `errors`."""

    def __init__(self, wait_s: float) -> None:
        self.barrier = threading.Barrier(2, timeout=wait_s)
        self.slots: list = [None, None]
        self.errors: list[str] = []

    def all_reduce(self, rank: int, kind: str, values: list[float]) -> list[float]:
        self.slots[rank] = (kind, values)
        try:
            self.barrier.wait()
            mine, theirs = self.slots[rank], self.slots[1 - rank]
            self.barrier.wait()
        except threading.BrokenBarrierError:
            self.errors.append(f"rank {rank} left waiting in {kind}")
            raise
        if mine[0] != theirs[0] or len(mine[1]) != len(theirs[1]):
            self.errors.append(f"rank {rank}: {mine[0]} met {theirs[0]}")
            raise RuntimeError("mismatched collectives")
        return [a + b for a, b in zip(mine[1], theirs[1], strict=True)]


def _on_two_ranks(run_rank) -> None:
    """`run_rank(rank)` on two threads at once, standing for two tensor-parallel ranks."""
    threads = [threading.Thread(target=run_rank, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)


def _assert_pass_0_failed_on_both_ranks(group: _TwoRankGroup, outcomes: dict, expected: list, agreed: bool) -> None:
    """With the agreement: both ranks failed pass 0 (rank 1 with its own fault, rank 0 as OtherRankFailed)
    and finished pass 1 with its answer alone. Without it (the control): their collectives came apart."""
    if not agreed:
        assert group.errors  # the control: without the agreement the ranks' collectives come apart
        return
    assert not group.errors, group.errors
    for rank in (0, 1):
        advanced = outcomes[rank]
        assert set(advanced.failed) == {0} and set(advanced.finished) == {1}, (rank, advanced)
        assert isinstance(advanced.failed[0], OtherRankFailed if rank == 0 else RuntimeError)
        assert_same(advanced.finished[1][0], expected[1][0])


def _rank_batch(engine, group: _TwoRankGroup, rank: int, agreed: bool) -> PassBatch:
    """One rank's PassBatch: its `Output` ops all-reduce the batch's rows (the row-parallel o_proj / MLP
    all-reduce), and with `agreed` the ranks agree on failures over the same group."""

    def execute(ops):
        if isinstance(ops[0], Output):
            group.all_reduce(rank, "model", [0.0] * sum(int(op.attn.shape[0]) for op in ops))
        return Fusor.execute_ops(engine.fusor, ops)

    def agree(failed: list[bool]) -> list[bool]:
        return [total > 0 for total in group.all_reduce(rank, "agreement", [float(f) for f in failed])]

    return PassBatch(execute, agree if agreed else None)


def _raising_after_layer(steps, layer: int):
    """The pass, raising when resumed after `layer` (a fault between layers: its loader, its merge)."""
    op = next(steps)
    while True:
        value = yield op
        if isinstance(op, LayerDone) and op.layer == layer:
            steps.close()
            raise RuntimeError(f"injected fault after layer {layer}")
        try:
            op = steps.send(value)
        except StopIteration as done:
            return done.value


@pytest.mark.parametrize("agreed", [True, False])
def test_a_pass_failing_on_one_rank_fails_on_every_rank_before_the_next_collective(engine, agreed):
    """Two ranks run the same two passes; the model's `Output` op holds an all-reduce. Rank 1's first pass
    raises after layer 1. With the agreement, both ranks fail that pass together before the next
    all-reduce, and both finish the other one with its answer alone. Negative control (no agreement):
    rank 0 meets a collective rank 1 never enters, or pairs it with another one."""
    plans = [plan(engine.cases[0]), plan(engine.cases[1])]
    expected = alone(engine, plans)
    group = _TwoRankGroup(wait_s=10.0)
    outcomes: dict[int, object] = {}

    def run_rank(rank: int) -> None:
        batch = _rank_batch(engine, group, rank, agreed)
        first = engine.fuse_steps(plans[0])
        batch.add(0, _raising_after_layer(first, 1) if rank == 1 else first)
        batch.add(1, engine.fuse_steps(plans[1]))
        outcomes[rank] = batch.advance()

    _on_two_ranks(run_rank)
    _assert_pass_0_failed_on_both_ranks(group, outcomes, expected, agreed)


@pytest.mark.parametrize("agreed", [True, False])
def test_a_pass_failing_on_one_rank_mid_split_beside_a_pass_at_another_layer(engine, agreed):
    """Pass 0 is split across two engine steps (a budget of rows), pass 1 starts in the second step: the two
    are at different layers, so their op groups differ. Rank 1's pass 0 raises after layer 2, in the second
    step. With the agreement before every op group both ranks drop pass 0 before they form the next group,
    and finish pass 1 with its answer alone. Negative control: no agreement."""
    plans = [plan(engine.cases[0]), plan(engine.cases[1])]
    expected = alone(engine, plans)
    group = _TwoRankGroup(wait_s=10.0)
    outcomes: dict[int, list] = {0: [], 1: []}
    first_step_rows = 1.5 * len(engine.cases[0].token_ids)  # pass 0 stops after its first layer or two

    def run_rank(rank: int) -> None:
        batch = _rank_batch(engine, group, rank, agreed)
        first = engine.fuse_steps(plans[0])
        batch.add(0, _raising_after_layer(first, 2) if rank == 1 else first)
        try:
            outcomes[rank].append(batch.advance(first_step_rows))
            batch.add(1, engine.fuse_steps(plans[1]))
            outcomes[rank].append(batch.advance())
        except (RuntimeError, threading.BrokenBarrierError):
            pass  # the control's mismatched collective

    _on_two_ranks(run_rank)
    if not agreed:
        assert group.errors
        return
    assert not group.errors, group.errors
    for rank in (0, 1):
        first_step, second_step = outcomes[rank]
        assert not first_step.failed and not first_step.finished  # pass 0 split, still running
        assert set(second_step.failed) == {0} and set(second_step.finished) == {1}, (rank, second_step)
        assert_same(second_step.finished[1][0], expected[1][0])


_RANK = threading.local()


def _tp_engine(engine, group: _TwoRankGroup) -> FusionEngine:
    """`engine`'s store and model as one rank of a TP=2 group whose passes yield their own collectives (the
    hit agreement, score sums) as RankSum ops; the calling thread's `_RANK.rank` says which rank runs them.
    Both "ranks" hold every head, so each sum is twice one rank's: the same hits and rankings as alone."""

    def sum_over_ranks(values: torch.Tensor) -> torch.Tensor:
        return torch.tensor(group.all_reduce(_RANK.rank, "rank_sum", values.tolist()), dtype=values.dtype)

    return FusionEngine(engine.adapter, engine.store, engine.key_context, engine.config, metastore=engine.metastore,
                        ranks=RankGroup(size=2, sum_over_ranks=sum_over_ranks))


def _raising_instead_of(steps, fails_at):
    """The pass, raising where it would yield the first op that `fails_at` picks (its own code failed
    just before that op: before a collective, when the op holds one)."""
    value = None
    while True:
        try:
            op = steps.send(value)
        except StopIteration as done:
            return done.value
        if fails_at(op):
            steps.close()
            raise RuntimeError(f"injected fault before {type(op).__name__} of layer {op.layer}")
        value = yield op


_FAULTS = {
    # before the ranks' agreement on hits, the pass's first collective
    "start": ("cacheblend", lambda op: isinstance(op, RankSum) and op.layer == START_LAYER),
    # in the question probe, after its layer-0 output's all-reduce: the first Output a fusionrag pass yields
    "probe": ("fusionrag", lambda op: isinstance(op, Output)),
    # in the check layer's selection, before its score sum
    "check": ("cacheblend", lambda op: isinstance(op, RankSum) and op.layer == 1),
}


@pytest.mark.parametrize("agreed", [True, False])
@pytest.mark.parametrize("where", sorted(_FAULTS))
def test_a_pass_failing_on_one_rank_anywhere_leaves_no_rank_in_a_collective(engine, where, agreed):
    """Every collective of a pass is an op of the batch: the model's (its `Output` all-reduce here) and the
    pass's own (RankSum: the hit agreement, the probe's and the check layer's score sums). Rank 1's first
    pass fails where `where` says, rank 0's does not; with the agreement both fail it before either enters
    another collective, and both finish the second pass with its answer alone. Negative control (no
    agreement): the ranks' collectives come apart."""
    selector, fails_at = _FAULTS[where]
    plans = [plan(engine.cases[0], selector, 0.3), plan(engine.cases[1])]
    expected = alone(engine, plans)
    group = _TwoRankGroup(wait_s=10.0)
    tp = _tp_engine(engine, group)
    outcomes: dict[int, object] = {}

    def run_rank(rank: int) -> None:
        _RANK.rank = rank
        batch = _rank_batch(tp, group, rank, agreed)
        first = tp.fuse_steps(plans[0])
        batch.add(0, _raising_instead_of(first, fails_at) if rank == 1 else first)
        batch.add(1, tp.fuse_steps(plans[1]))
        try:
            outcomes[rank] = batch.advance()
        except (RuntimeError, threading.BrokenBarrierError):
            pass  # the control's mismatched collective

    _on_two_ranks(run_rank)
    _assert_pass_0_failed_on_both_ranks(group, outcomes, expected, agreed)


def test_a_tensor_parallel_pass_yields_its_collectives_as_ops(engine):
    """Under TP a cacheblend pass sums over the ranks exactly twice, both as RankSum ops (the hits before
    its first layer, the check layer's scores); a fusionrag pass once more, its probe's scores; passes batched
    together cross the ranks once per group. With both "ranks" alike the answers are those of one rank."""
    plans = [plan(engine.cases[0], "fusionrag", 0.3), plan(engine.cases[1]), plan(engine.cases[2])]
    expected = alone(engine, plans)
    sums = []

    def sum_over_ranks(values):
        sums.append(values.numel())
        return 2 * values

    tp = FusionEngine(engine.adapter, engine.store, engine.key_context, engine.config, metastore=engine.metastore,
                      ranks=RankGroup(size=2, sum_over_ranks=sum_over_ranks))
    seen = []

    def execute(ops):
        seen.append((type(ops[0]).__name__, ops[0].layer, len(ops)))
        return Fusor.execute_ops(tp.fusor, ops)

    batch = PassBatch(execute)
    for i, p in enumerate(plans):
        batch.add(i, tp.fuse_steps(p))
    advanced = batch.advance()
    for i in range(3):
        assert_same(advanced.finished[i][0], expected[i][0])
    rank_sums = [entry for entry in seen if entry[0] == "RankSum"]
    assert rank_sums[0] == ("RankSum", START_LAYER, 3)  # the three passes' hits, one all-reduce
    assert len(sums) == len(rank_sums) and sum(n for _, _, n in rank_sums) == 3 + 2 + 1  # hits, checks, probe
    # Negative control: on one rank no pass yields a RankSum
    seen.clear()
    batch = PassBatch(lambda ops: seen.append(type(ops[0]).__name__) or Fusor.execute_ops(engine.fusor, ops))
    batch.add(0, engine.fuse_steps(plans[0]))
    batch.advance()
    assert "RankSum" not in seen

r"""Blend passes run together: the ops a pass asks for, and the driver that batches them and bounds them.

Imports only torch. A pass (`Fusor.fuse_steps`, `FusionEngine.fuse_steps`) is a generator that keeps
its own per-request logic (selection, merging, holes, statistics) and yields every op whose work is
row-wise over the model's weights: the embedding, the layer's projections, attention, the layer's output
and MLP, the logits. `PassBatch` runs the passes of several requests in lockstep and executes each op
once for all of them, their rows concatenated as vLLM batches prefills:

```
request a:  [rows a]  \                       / [rows a] -> a's pass (merge, select, attend over a's K/V)
request b:  [rows b]   > one matmul per op   <  [rows b] -> b's pass
request c:  [rows c]  /                       \ [rows c] -> c's pass
```

A row's result depends only on its own row (norms, projections, RoPE, MLP) or, for attention, on its
own request's keys (the varlen op), so every request gets the rows it would get alone. Each pass also
yields `LayerDone` after every layer: the points where `advance` may stop within a budget of rows and
resume in a later engine step (a split blend), with no timer running while it waits.

Under tensor parallelism every rank runs the same passes in the same order, and the model's ops hold
collectives (the row-parallel all-reduces of `Output`, the embedding's, the logits' gather), and a pass
has collectives of its own: the ranks' agreement on its hits and the sums of its per-row scores (each rank
scores its own heads). Every one of them is an op the pass yields (`RankSum` for the pass's own), so no
pass code runs a collective: pass code runs only between ops. A pass that fails on one rank only must
fail on all before any of them enters the next collective, or the others wait in it for good. With
`agree` set, a pass that fails or ends here is only marked; before every op group is chosen (and after a
cohort starts), one `agree` call (an all-reduce of a flag per pass) makes a failure anywhere a failure
everywhere (`OtherRankFailed`), and only then are passes retired. So the ranks always choose the same
group, passes at different layers included (a split blend beside a newer one), and wherever a pass fails
(its start, its question probe, its selection, a layer) the others never wait in a collective for it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# The stages of one layer, in the order a pass yields them, and RANK_SUM wherever a pass sums over the ranks
# (`op_key` groups the ops of a batch by layer and stage).
EMBED, PROJECT, ATTEND, OUTPUT, LAYER_DONE, LOGITS, RANK_SUM = range(7)
START_LAYER = -1
"""The `layer` of the ops a pass yields before its first layer (its hit agreement, its embedding)."""

Agreement = Callable[[list[bool]], list[bool]]
"""(whether each pass failed on this rank) -> (whether it failed on any rank): a collective, called with
the same passes in the same order on every rank."""


class OtherRankFailed(RuntimeError):
    """The pass failed on another tensor-parallel rank: this rank's copy stops too (all fall back)."""


@dataclass
class Embed:
    """The embedding of `token_ids` [T] -> hidden [T, hidden_size]."""

    token_ids: torch.Tensor
    stage = EMBED
    layer = START_LAYER


@dataclass
class Project:
    """Residual add, input norm, q/k/v projections and RoPE at `positions` of `layer`'s rows ->
    (q, k, k_nope, v, residual)."""

    layer: int
    hidden: torch.Tensor
    residual: torch.Tensor | None
    positions: torch.Tensor
    stage = PROJECT


@dataclass
class Attend:
    """Attention of `q` (rows `query_rows`, None: every row causally) over the merged `k`/`v` of its
    own request, through its `backend` (None: the fusor's own attention) -> [R, heads, head_dim]."""

    layer: int
    backend: Any
    q: torch.Tensor
    query_rows: torch.Tensor | None
    k: torch.Tensor
    v: torch.Tensor
    stage = ATTEND


@dataclass
class Output:
    """o_proj, residual add, post-attention norm and MLP of `attn` [R, heads * head_dim] -> (hidden, residual)."""

    layer: int
    attn: torch.Tensor
    residual: torch.Tensor
    stage = OUTPUT


@dataclass
class LayerDone:
    """The pass finished `layer`, having computed `rows` rows in it over `keys` keys (the prompt's tokens):
    what the budget charges it (`PassBatch`'s `charge`; by default its rows)."""

    layer: int
    rows: int
    keys: int = 0
    stage = LAYER_DONE


Charge = Callable[[LayerDone], float]
"""What a finished layer costs of the budget, in the budget's unit (rows of a full layer)."""


@dataclass
class Logits:
    """Final norm and LM head of the last row -> [1, vocab] fp32."""

    hidden: torch.Tensor
    residual: torch.Tensor
    stage = LOGITS
    layer = 1 << 30


@dataclass
class RankSum:
    """`values` summed over the tensor-parallel ranks (one all-reduce for every pass of the group, their
    values concatenated): the pass's own collectives, its agreement on hits before its first layer and
    its score sums (each rank scores only its own heads). Yielded only under tensor parallelism."""

    values: torch.Tensor
    layer: int
    """START_LAYER for the hit agreement; else the layer whose scores are summed."""
    stage = RANK_SUM


PassOp = Embed | Project | Attend | Output | LayerDone | Logits | RankSum
PassSteps = Generator[PassOp, Any, Any]
"""A blend pass: yields ops, is sent each op's result, returns its result."""
ExecuteOps = Callable[[list[Any]], list[Any]]
"""Runs one group of ops of the same stage and layer (one per request) -> their results, in order."""


def op_key(op: Any) -> tuple[int, int]:
    return op.layer, op.stage


def at_start(op: Any) -> bool:
    """Whether a pass waiting on `op` has not begun its first layer (it can still join a cohort)."""
    return op.layer == START_LAYER


def summed_over_ranks(values: torch.Tensor, layer: int, across_ranks: bool) -> PassSteps:
    """`values` summed over the tensor-parallel ranks, as a RankSum op of the pass (`yield from` it);
    on one rank (`across_ranks` False) `values` as they are, no op yielded."""
    return (yield RankSum(values, layer)) if across_ranks else values


def run_alone(steps: PassSteps, execute: ExecuteOps) -> Any:
    """Runs one pass to its end, each op on its own; returns what the pass returns."""
    result = None
    while True:
        try:
            op = steps.send(result)
        except StopIteration as done:
            return done.value
        result = None if isinstance(op, LayerDone) else execute([op])[0]


@dataclass
class _Job:
    job_id: Hashable
    steps: PassSteps
    estimated_rows: float
    """The pass's rows summed over its layers, as estimated when it joined (forms cohorts within a budget)."""
    op: Any = None
    """The op the pass waits on; None until it is started."""
    steps_run: int = 0
    """`advance` calls in which the pass did work (1: the blend ran within one engine step)."""
    last_advance: int = -1
    batch_size: int = 1
    """The most passes its ops ran with."""
    settled: tuple[str, Any] | None = None
    """("finished", result) or ("failed", exception) awaiting the ranks' agreement (with `agree` only)."""


@dataclass
class Advanced:
    """What one `advance` did: results and failures by job id, and the rows it computed."""

    finished: dict[Hashable, Any] = field(default_factory=dict)
    failed: dict[Hashable, BaseException] = field(default_factory=dict)
    rows: float = 0.0
    """The budget spent: the finished layers' charges (their rows, unless the batch prices them)."""
    split: dict[Hashable, tuple[int, int]] = field(default_factory=dict)
    """Per finished or failed job: (engine steps it ran in, the most passes it was batched with)."""


class PassBatch:
    """Passes of several requests advanced together, oldest first, within a budget of rows per call.

    Order: the oldest pass's next op is run for every pass waiting at the same op (same stage, same
    layer), so passes that start together stay in lockstep as one cohort, and passes that join later run
    after the cohort ahead of them, batched with each other. A cohort starts with the oldest waiting pass
    and those behind it whose estimated rows fit what is left of the budget, so a burst of arrivals is
    cut into cohorts that each finish sooner than all of them would together. A pass is started (its
    entries read, its probe run) only when its cohort starts.
    """

    def __init__(self, execute: ExecuteOps, agree: Agreement | None = None, charge: Charge | None = None) -> None:
        self.execute = execute
        self.agree = agree
        self.charge: Charge = charge or (lambda done: float(done.rows))
        """What each finished layer costs of `advance`'s budget (the worker's: its measured cost in rows of a
        full layer, as the scheduler estimates passes; by default its rows)."""
        self.agreements = 0
        """`agree` calls made (each one collective: its cost is this count times one small all-reduce)."""
        self.jobs: list[_Job] = []
        self._advances = 0

    def __len__(self) -> int:
        return len(self.jobs)

    def __contains__(self, job_id: Hashable) -> bool:
        return any(job.job_id == job_id for job in self.jobs)

    def add(self, job_id: Hashable, steps: PassSteps, estimated_rows: float = 0.0) -> None:
        self.jobs.append(_Job(job_id, steps, estimated_rows))

    def cancel(self, job_id: Hashable) -> bool:
        """Stops a pass where it stands (its `finally` blocks and context managers run: pins and loader
        threads are released); False when no such pass is here."""
        for job in self.jobs:
            if job.job_id == job_id:
                self.jobs.remove(job)
                job.steps.close()
                return True
        return False

    def close(self) -> None:
        for job in list(self.jobs):
            self.cancel(job.job_id)

    def advance(self, budget_rows: float | None = None) -> Advanced:
        """Runs the passes until they end, or until `budget_rows` rows are computed (checked between
        layers: a layer is never cut). None: no budget, every pass ends in this call."""
        self._advances += 1
        done = Advanced()
        while True:
            if self.agree is not None:
                # Before choosing the next group: a pass failed on one rank only would otherwise leave the
                # ranks choosing different groups (passes at different layers: a split blend beside a newer
                # one), and their collectives would pair up wrong.
                self._agree(done)
            if not self._live():
                break
            over = budget_rows is not None and done.rows >= budget_rows
            oldest = self._live()[0]
            if oldest.op is None or at_start(oldest.op):
                if over:
                    break
                cohort = self._cohort(None if budget_rows is None else budget_rows - done.rows, done)
                if self.agree is not None:  # starting them ran pass code that may have failed on one rank
                    self._agree(done)
                    cohort = [job for job in cohort if job.settled is None]
                if not cohort:
                    continue  # every pass of it failed or ended on starting
                # Its passes wait at their hit agreement or their embedding: the first one's op runs first
                key = op_key(cohort[0].op)
                group = [job for job in cohort if op_key(job.op) == key]
            else:
                if over and isinstance(oldest.op, LayerDone):
                    break
                key = op_key(oldest.op)
                group = [job for job in self._live() if job.op is not None and op_key(job.op) == key]
            self._run(group, done)
        return done

    def _live(self) -> list[_Job]:
        """Passes still running here (with `agree`, settled ones wait in `jobs` for the agreement)."""
        return [job for job in self.jobs if job.settled is None]

    def _agree(self, done: Advanced) -> None:
        """One agreement over every pass here: a pass failed on any rank fails on all; settled passes retire."""
        if not self.jobs:
            return
        self.agreements += 1
        failed_anywhere = self.agree([job.settled is not None and job.settled[0] == "failed" for job in self.jobs])
        for job, failed in zip(list(self.jobs), failed_anywhere, strict=True):
            if failed and (job.settled is None or job.settled[0] != "failed"):
                job.steps.close()
                job.settled = ("failed", OtherRankFailed("the blend pass failed on another tensor-parallel rank"))
            if job.settled is not None:
                kind, value = job.settled
                self._retire(job, done)
                (done.finished if kind == "finished" else done.failed)[job.job_id] = value

    def _cohort(self, budget_left: float | None, done: Advanced) -> list[_Job]:
        """Starts the oldest waiting pass and those behind it that fit `budget_left`; those still before
        their first layer are the cohort."""
        cohort: list[_Job] = []
        rows = 0.0
        for job in self._live():
            if job.op is not None and not at_start(job.op):
                continue  # mid-pass, in a cohort ahead
            if cohort and budget_left is not None and rows + job.estimated_rows > budget_left:
                break
            if job.op is None:
                self._mark_worked(job)
                self._send(job, None, done)
            if job.settled is None and job in self.jobs and at_start(job.op):
                cohort.append(job)
                rows += job.estimated_rows
        return cohort

    def _run(self, group: list[_Job], done: Advanced) -> None:
        ops = [job.op for job in group]
        for job in group:
            self._mark_worked(job)
        if isinstance(ops[0], LayerDone):  # charged when it was yielded: resume into the next layer
            results: list[Any] = [None] * len(group)
        else:
            for job in group:
                job.batch_size = max(job.batch_size, len(group))
            try:
                results = self.execute(ops)
            except Exception as exc:  # noqa: BLE001 - one failed batch fails its passes, not the engine
                for job in group:
                    self._fail(job, exc, done)
                return
        for job, result in zip(group, results, strict=True):
            self._send(job, result, done)

    def _mark_worked(self, job: _Job) -> None:
        if job.last_advance != self._advances:
            job.last_advance = self._advances
            job.steps_run += 1

    def _send(self, job: _Job, value: Any, done: Advanced) -> None:
        try:
            job.op = job.steps.send(value)
            if isinstance(job.op, LayerDone):  # the layer is charged to the call that computed it
                done.rows += self.charge(job.op)
        except StopIteration as finished:
            if self.agree is not None:  # another rank may yet have failed it
                job.settled = ("finished", finished.value)
                return
            self._retire(job, done)
            done.finished[job.job_id] = finished.value
        except Exception as exc:  # noqa: BLE001 - the pass's own failure is its request's, not the batch's
            self._fail(job, exc, done)

    def _fail(self, job: _Job, exc: BaseException, done: Advanced) -> None:
        if job in self.jobs and job.settled is None:
            job.steps.close()
            if self.agree is not None:  # retired at the next agreement, on every rank at once
                job.settled = ("failed", exc)
                return
            self._retire(job, done)
            done.failed[job.job_id] = exc

    def _retire(self, job: _Job, done: Advanced) -> None:
        self.jobs.remove(job)
        done.split[job.job_id] = (job.steps_run, job.batch_size)


def split_rows(tensor: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    """`tensor`'s rows cut back into the requests' rows (views)."""
    return list(torch.split(tensor, list(counts)))

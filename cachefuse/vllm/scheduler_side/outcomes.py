"""Per-request outcomes: what a response's `kv_transfer_params["cachefuse"]` says, counted and logged once.

Imports only the standard library and cachefuse.chunks (PARAMS_KEY); no torch, no vllm: the hooks hand
in the stats object vLLM collects (`CacheFuseConnectorStats`, anything with `record(**counts)` and
`sample(**values)`).

A request's outcome (`RequestOutcome`) is created when it is planned (planning.py) or falls back, and
its response dict (`to_response`, the one place it becomes one) is returned by `request_finished`; vLLM
passes that same dict on to the response, and in the step where the blend ran the worker's figures
arrive (update_connector_output) after request_finished, so the outcome keeps the dict it handed out
current. Its `status` ends as one of the documented values: `fused`, `fallback`, or `not_run` (planned,
but the request finished before its blend ran); never the internal `planned`.

Counting: vLLM asks about a request every step it waits for blocks, and again after each preemption,
so the request counters (`requests_fused`, `requests_fallback` and its reasons, the controller's verdict,
the fused request's ratio) count a request once, by its final outcome, when it finishes (`finish`),
never per call or per blend. Counters of events
(`requests_replanned_after_preemption`, misses, save failures) count each event.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cachefuse.chunks import PARAMS_KEY

if TYPE_CHECKING:
    from cachefuse.vllm.metrics import CacheFuseConnectorStats

logger = logging.getLogger(__name__)


@dataclass
class RequestOutcome:
    """What a response's `kv_transfer_params["cachefuse"]` says about one request (docs/deploy.md).

    A field left None is absent from the response. The worker's figures of the request's last blend are
    kept in `figures` by their own names (FusionStats'), except those named like a field, which set it.
    `to_response` hands out the response's dict and keeps it current: vLLM passes that dict on to the
    response, and the figures of the step that ran the blend arrive after `request_finished` returned it.
    """

    status: str
    """`planned` (internal: its blend has not reported yet), then `fused`, `fallback` or `not_run`."""
    fallback_reason: str | None = None
    detail: str | None = None
    field: str | None = None
    """The request field at fault, for `malformed_request` and `over_limit`."""
    selector: str | None = None
    recompute_ratio: float | None = None
    chunks: int | None = None
    """Declared chunks."""
    chunks_indexed: int | None = None
    """Declared chunks the scheduler's index planned to load."""
    controller: dict[str, Any] | None = None
    """The loading controller's decision (its Decision's fields), in `ratio_mode: controller`."""
    preemptions: int | None = None
    """Times vLLM preempted the request after its blend ran and admitted it again."""
    fused_before_preemption: bool | None = None
    replay_exact: bool | None = None
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The worker's figures, but for those named like a field; a figure it sends as None stays here."""
    _response: dict[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    def update(self, **changes: Any) -> None:
        """The scheduler's changes (fields by name, never None): they replace any figure of the same name."""
        for name, value in changes.items():
            assert name in SCHEDULER_FIELDS and value is not None, (name, value)
            setattr(self, name, value)
            self.figures.pop(name, None)
        self._refresh()

    def add_figures(self, figures: dict[str, Any]) -> None:
        """The worker's figures of a blend: those named like a field set it (a None one unsets it and stays
        a figure, so the response still carries the key, as None), the rest are kept as they are."""
        for name, value in figures.items():
            if name in SCHEDULER_FIELDS:
                setattr(self, name, value)
                if value is not None:
                    self.figures.pop(name, None)
                    continue
            self.figures[name] = value
        self._refresh()

    def to_dict(self) -> dict[str, Any]:
        """The outcome as the response says it: fields that are set, then the worker's figures."""
        out = {name: getattr(self, name) for name in SCHEDULER_FIELDS if getattr(self, name) is not None}
        out.update(self.figures)  # disjoint: a figure named like a field is there only while the field is None
        return out

    def to_response(self) -> dict[str, Any]:
        """The `kv_transfer_params` of the request's response: `{PARAMS_KEY: outcome}`. The inner dict is this
        outcome's own, kept current by every later change (figures arriving after request_finished)."""
        if self._response is None:
            self._response = {}
        self._refresh()
        return {PARAMS_KEY: self._response}

    def _refresh(self) -> None:
        if self._response is not None:
            self._response.clear()
            self._response.update(self.to_dict())


SCHEDULER_FIELDS = tuple(f.name for f in dataclasses.fields(RequestOutcome) if f.name not in ("figures", "_response"))
"""The response keys the scheduler writes (RequestOutcome's fields, in order); the worker's figures may write
some of them too (`status`, `selector`, ...), and the later write of a key wins, as it did when the outcome
was a dict updated in place."""


class Outcomes:
    """The outcomes of requests not (or no longer) planned, the counters, and the stats vLLM collects."""

    def __init__(self, stats: CacheFuseConnectorStats) -> None:
        self.stats = stats
        self.counters: Counter[str] = Counter()
        self.fallbacks: dict[str, RequestOutcome] = {}  # req_id -> outcome of a request running as plain vLLM
        self.awaiting: dict[str, RequestOutcome] = {}  # outcomes returned, awaiting this step's worker figures
        self.resumed_plain: set[str] = set()  # resumed as plain vLLM after a blend ran: counted when admitted

    def fall_back(self, req_id: str, reason: str, *, detail: str, field: str | None = None) -> None:
        """The request runs as plain vLLM, saying why (the caller drops its plan, if any)."""
        outcome = RequestOutcome(status="fallback", fallback_reason=reason, detail=detail, field=field)
        previous = self.fallbacks.get(req_id)
        self.fallbacks[req_id] = outcome  # counted when the request finishes: vLLM may ask again, or plan it
        if previous != outcome:  # vLLM asks again every step the request waits for blocks: say it once
            logger.info("cachefuse: request %s runs as plain vLLM (%s: %s)", req_id, reason, detail)

    def count_resumption(self, outcome: RequestOutcome) -> None:
        """One more time vLLM preempted the request after its blend ran and admitted it again."""
        outcome.update(preemptions=(outcome.preemptions or 0) + 1)
        self.counters["requests_replanned_after_preemption"] += 1

    def admitted(self, req_id: str) -> None:
        """vLLM allocated blocks for the request: one that resumed as plain vLLM after its blend ran counts
        its resumption now."""
        if req_id in self.resumed_plain:
            self.resumed_plain.discard(req_id)
            outcome = self.fallbacks.get(req_id)
            if outcome is not None:
                self.count_resumption(outcome)

    def record_blend(self, req_id: str, figures: dict[str, Any], planned: RequestOutcome | None) -> None:
        """One blend's figures: its events counted now, its request's outcome (`planned`: the outcome of its
        plan, while the request runs) filled in place, and counted once the request has finished: a
        preempted request is blended again."""
        for miss, count in (figures.get("miss_reasons") or {}).items():
            self.counters[f"miss:{miss}"] += count
        self.counters["save_failures"] += figures.get("save_failures", 0)
        self.counters["saves_skipped"] += figures.get("saves_skipped", 0)
        finished = self.awaiting.pop(req_id, None)
        outcome = finished if finished is not None else planned
        if outcome is None:
            return
        if outcome.preemptions:  # a replay's figures
            figures = {**figures, **_replay_outcome(figures)}
            if outcome.replay_exact is not None:  # inexact once, inexact for good: earlier tokens saw older K/V
                figures["replay_exact"] = bool(outcome.replay_exact and figures.get("replay_exact", True))
        outcome.add_figures(figures)
        if finished is not None:
            self.finish(req_id, finished)

    def end_step(self) -> None:
        """The worker's output of a step has been read: a returned outcome still planned got no figures (a
        blend's arrive in the step that ran it, or never)."""
        for req_id, outcome in self.awaiting.items():
            if outcome.status == "planned":
                outcome.update(status="not_run", detail="no figures came back from the worker for its blend")
                self.finish(req_id, outcome)
        self.awaiting.clear()

    def request_finished(self, req_id: str, planned: RequestOutcome | None,
                         figures_due: bool) -> dict[str, Any] | None:
        """The response's `kv_transfer_params` of a finished request, or None when cachefuse has nothing to say.

        Args:
            planned: the outcome of its plan, when it had one; else its fallback's (if any) is used.
            figures_due: its plan was sent and the worker's figures for it have not arrived yet.
        """
        fallback = self.fallbacks.pop(req_id, None)  # all dropped: nothing outlives the request, whatever its path
        self.resumed_plain.discard(req_id)
        outcome = planned if planned is not None else fallback
        if outcome is None:
            return None
        if planned is not None and figures_due:
            # vLLM frees a request finished in a step before it hands the connector that step's worker
            # output: the figures of the blend (or replay) that ran in it fill (and count) it in place
            self.awaiting[req_id] = outcome
            return outcome.to_response()
        if planned is not None and outcome.status == "planned":
            # planned, never scheduled: aborted, or stopped while waiting (e.g. after a preemption)
            outcome.update(status="not_run", detail="the request finished before its blend ran")
        self.finish(req_id, outcome)  # a fallback decided here, or a blend whose figures came in an earlier step
        return outcome.to_response()

    def finish(self, req_id: str, outcome: RequestOutcome) -> None:
        """A finished request's final outcome, counted and logged once (`not_run` counts as neither)."""
        status = outcome.status
        verdict = _controller_verdict(outcome)
        if verdict is not None:
            self.stats.record(**{f"controller_{verdict}": 1})
        if status == "fused":
            self.counters["requests_fused"] += 1
            self.stats.record(requests_fused=1)
            if outcome.recompute_ratio is not None:
                self.stats.sample(recompute_ratio=outcome.recompute_ratio)
        elif status == "fallback":
            reason = outcome.fallback_reason
            self.counters["requests_fallback"] += 1
            self.counters[f"fallback:{reason}"] += 1
            self.stats.record(**{"requests_fallback": 1, f"fallback_{reason}": 1})
        _log_outcome(req_id, outcome)


def _controller_verdict(outcome: RequestOutcome) -> str | None:
    """The loading controller's verdict on a request, if it decided one: the plan keeps the decision; a no-go
    keeps only its fallback reason (the plan is dropped)."""
    if outcome.controller is not None:
        return outcome.controller.get("verdict")
    return "no_go" if outcome.status == "fallback" and outcome.fallback_reason == "no_go" else None


def _replay_outcome(figures: dict[str, Any]) -> dict[str, Any]:
    """What a replay that failed adds to its request's outcome: its earlier tokens were fused (a replay
    that ran says itself whether it was exact: `replay_exact`, from the worker)."""
    if figures.get("status") == "fallback":
        return {"fused_before_preemption": True, "replay_exact": False}
    return {}


def _log_outcome(req_id: str, outcome: RequestOutcome) -> None:
    """Every request's outcome, once, at DEBUG: also for responses that cannot carry it (a stop string ends
    a request in vLLM's front end before the engine's request_finished; streamed chunks are sent before)."""
    if logger.isEnabledFor(logging.DEBUG):
        fields = ("status", "fallback_reason", "chunks_hit", "chunks_missed", "tokens_reused", "tokens_recomputed",
                  "blend_time_s", "preemptions")
        said = outcome.to_dict()
        logger.debug("cachefuse: request %s outcome %s", req_id,
                     {name: said[name] for name in fields if said.get(name) is not None})

"""The scheduler half of CacheFuseConnector: plans, budget, index, per-request outcomes.

Runs inside vLLM's `Scheduler.schedule()` hot path: no tensors, no network, no file reads per
request. The variant index (cachefuse.metadata.index) is loaded from the metadata store at start-up,
kept current by the variants the worker reports saving and evicting, and reloaded by a background
thread when the store's generation changes (other engines sharing it). Each declared chunk's variant
is chosen here by CFO and sent in the plan (advisory: the worker re-checks every entry when it loads).

A request's outcome dict is created when it is planned and returned by `request_finished`; vLLM
passes that same object on to the response, and in the step where the blend ran the worker's
figures arrive (update_connector_output) after request_finished, so they are filled in place. Its
`status` ends as one of the documented values: `fused`, `fallback`, or `not_run` (planned, but the
request finished before its blend ran); never the internal `planned`.

Preemption: vLLM frees a preempted request's blocks and, when it resumes it, asks again how many
tokens the connector holds. The request is planned again (`preemptions` counts how often) and its
plan is sent with the new block table, which vLLM lists under the cached requests
(`resumed_req_ids`), not the new ones: the blend writes [0, N-1) again before vLLM recomputes the
rest. Without that plan vLLM would decode over blocks nothing wrote.

Counting: vLLM asks about a request every step it waits for blocks, and again after each preemption,
so the request counters (`requests_fused`, `requests_fallback` and its reasons) count a request once,
by its final outcome, when it finishes (`_finish`), never per call or per blend. Counters of events
(`requests_replanned_after_preemption`, misses, save failures) count each event.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from cachefuse.chunks import (
    PARAMS_KEY,
    KeyContext,
    chunk_key,
    dtype_name,
    model_fingerprint,
    resolve_model_dir,
    tokenize_piece,
)
from cachefuse.config import CacheFuseConfig
from cachefuse.errors import RequestError, RequestLimitError
from cachefuse.loading.controller import RequestShape, decide, tier_bytes
from cachefuse.loading.figures import FIGURE_STALE_S, ComputeFigures, TierFigures
from cachefuse.metadata.backends import open_config_metastore
from cachefuse.metadata.base import record_from_dict
from cachefuse.metadata.index import Admission, IndexRefresher, VariantChoice, VariantIndex, plan_variants
from cachefuse.metadata.layer_profiles import with_profiled_layers
from cachefuse.redis_client import redact_url
from cachefuse.request import FusionRequest, parse_request, wants_fusion
from cachefuse.select.base import PlannedChunk
from cachefuse.select.registry import make_selector
from cachefuse.store.disk import DiskStore, list_keys
from cachefuse.vllm.messages import BlendPlan, CacheFuseMetadata, CacheFuseWorkerMeta
from cachefuse.vllm.metrics import CacheFuseConnectorStats

logger = logging.getLogger(__name__)



def _plain_prefill_tokens(scheduler_output: Any, plans: list[BlendPlan]) -> int:
    """Tokens of a step made of one new, unfused prefill and nothing else (0 otherwise): a clean timing
    sample of a prompt of that length. A batch of k prompts costs k n^2 in attention, not (k n)^2: timed
    as one prompt of their summed tokens, it had fitted the quadratic term ~k times too small."""
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    new_ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
    if plans or len(scheduled) != 1 or set(scheduled) != new_ids:
        return 0
    return int(sum(scheduled.values()))


def _scheduled_block_ids(scheduler_output: Any) -> dict[str, list[int]]:
    """req_id -> its whole block table, for the requests whose prompt this step computes from scratch:
    new ones, and preempted ones resumed this step. vLLM lists a resumed request among the cached
    requests (`resumed_req_ids`), its `new_block_ids` replacing the blocks it held before."""
    block_ids_of = {r.req_id: list(r.block_ids[0]) for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None) or ()
    for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
        if req_id in resumed and new_block_ids is not None:
            block_ids_of[req_id] = list(new_block_ids[0])
    return block_ids_of


@dataclass
class _Pending:
    request: FusionRequest
    token_ids: list[int]
    outcome: dict[str, Any]
    variants: list[VariantChoice | None] = field(default_factory=list)
    block_ids: list[int] | None = None
    sent: bool = False
    replay: bool = False
    """Preempted after its blend ran: the next blend replays this plan (SchedulerSide._replay)."""
    figures_due: bool = False
    """Its plan was sent and the worker's figures for it have not arrived yet."""


@dataclass
class _StepBudget:
    tokens: int = 0
    req_ids: set[str] = field(default_factory=set)


class SchedulerSide:
    def __init__(self, vllm_config: Any, config: CacheFuseConfig) -> None:
        self.config = config
        model_config = vllm_config.model_config
        self.block_size = vllm_config.cache_config.block_size
        self.key_context = KeyContext(
            model_fingerprint(resolve_model_dir(model_config)), dtype_name(model_config.dtype),
            vllm_config.parallel_config.tensor_parallel_size, 0, config.compute_hash())
        # The worker's critical layers (a stored `cachefuse profile-layers`), for the probe's estimate
        config = with_profiled_layers(config, config.store_path, self.key_context.model_fingerprint,
                                      model_config.hf_text_config.num_hidden_layers)
        self.config = config
        self.index = VariantIndex()
        self._refresher = self._start_index(config, self.key_context.tp_size)
        self._model_config = model_config
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._tokenizer = _load_tokenizer(model_config.tokenizer)  # now, not inside the first schedule()
        self._pending: dict[str, _Pending] = {}
        self._fallbacks: dict[str, dict[str, Any]] = {}  # req_id -> outcome of a request running as plain vLLM
        self._awaiting: dict[str, dict[str, Any]] = {}  # outcomes returned, awaiting this step's worker figures
        self._resumed_plain: set[str] = set()  # resumed as plain vLLM after a blend ran: counted when admitted
        self._budget = _StepBudget()
        self.counters: Counter[str] = Counter()
        self.figures: dict[str, Any] = {}
        """The worker's latest measured figures (tiers' bytes/s, blend and prefill speed)."""
        self.clock = time.monotonic
        self._no_go_since: dict[str, float] = {}
        """Per tier, since when the controller has turned down requests whose load it bounds (and fused
        none of them): a tier's figure only changes when a blend reads it, so after FIGURE_STALE_S of
        that, one request is fused anyway to measure the tier again."""
        self._remeasuring: dict[str, dict[str, Any]] = {}
        """The forced decision of a request picked to re-measure, kept until the request finishes, so
        vLLM asking again (no free blocks yet) gets the same answer."""
        self._stats = CacheFuseConnectorStats()
        logger.info("cachefuse scheduler: %d variants indexed (%s)", len(self.index),
                    redact_url(config.redis_url) if config.redis_url else config.store_path)

    def _start_index(self, config: CacheFuseConfig, tp_size: int) -> IndexRefresher | None:
        """Loads the variant index once, then keeps it current on a background thread (other engines'
        saves reach it through the shared store). Never blocks planning: a failing store leaves the
        last snapshot and is retried every `index_refresh_interval_s`."""
        if config.redis_url is None and not config.disk_capacity_bytes:
            return None  # metadata in the worker's memory only: the worker's reports are the index
        # Rank 0's K/V entries on the local disk tier (those without metadata rows are base variants), listed
        # with every reload. A closure over plain values: the thread must not keep `self` alive.
        root = config.kv_store_path(tp_size, 0)
        plain_keys = (lambda: list_keys(root)) if config.disk_capacity_bytes else None
        refresher = IndexRefresher(self.index, lambda: open_config_metastore(config),
                                   config.index_refresh_interval_s, plain_keys=plain_keys, plain_tier=DiskStore.name)
        try:
            store = open_config_metastore(config)
            try:
                refresher.refresh_once(store)  # the first load: records and the disk listing
            finally:
                store.close()
        except Exception as exc:  # noqa: BLE001 - start serving; the refresher retries
            logger.warning("cachefuse scheduler: variant metadata unavailable at start-up (%s: %s); "
                           "chunks are misses until it answers", type(exc).__name__, exc)
            if plain_keys is not None:
                self.index.add_plain_keys(plain_keys(), tier=DiskStore.name)
        return refresher.start()

    def close(self) -> None:
        """Stops the index refresher (vLLM calls the connector's shutdown)."""
        if self._refresher is not None:
            self._refresher.stop()
            self._refresher = None

    # ------------------------------------------------------------------ planning

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not wants_fusion(params, self.config):
            return 0, False
        req_id, prompt = request.request_id, list(request.prompt_token_ids or [])
        if req_id in self._fallbacks and getattr(request, "num_output_tokens", 0):
            # It ran as plain vLLM, was preempted and resumes: its tokens so far came from plain K/V, and a
            # blend now would decode the rest over other K/V (an answer neither plain nor fused).
            if self._fallbacks[req_id].get("fused_before_preemption"):
                self._resumed_plain.add(req_id)  # its resumption counts when vLLM admits it
            return 0, False
        try:
            fusion = parse_request(params, prompt, self.config, self._tokenize)
        except RequestLimitError as exc:
            self._fall_back(req_id, "over_limit", detail=exc.reason, field=exc.field)
            return 0, False
        except RequestError as exc:
            self._fall_back(req_id, "malformed_request", detail=exc.reason, field=exc.field)
            return 0, False
        except Exception as exc:  # noqa: BLE001 - a parser bug must not stop vLLM's scheduler step
            logger.exception("cachefuse: request %s: parsing its parameters failed unexpectedly", req_id)
            self._fall_back(req_id, "malformed_request", detail=f"unexpected {type(exc).__name__} while parsing",
                            field=PARAMS_KEY)
            return 0, False
        if fusion is None or not fusion.chunks:
            return 0, False
        try:
            return self._plan(req_id, fusion, prompt, num_computed_tokens)
        except Exception as exc:  # noqa: BLE001 - a planning bug (or a row no check caught) must not stop schedule()
            logger.exception("cachefuse: request %s: planning failed unexpectedly", req_id)
            self._pending.pop(req_id, None)
            self._fall_back(req_id, "planning_error", detail=f"unexpected {type(exc).__name__} while planning")
            return 0, False

    def _plan(self, req_id: str, fusion: FusionRequest, prompt: list[int],
              num_computed_tokens: int) -> tuple[int | None, bool]:
        """The plan of one parsed request (or its fallback): variants, budget, the controller's ratio."""
        if num_computed_tokens:  # prefix caching is off (checked at start-up); keep plain vLLM if not
            self._fall_back(req_id, "local_prefix_hit", detail=f"{num_computed_tokens} tokens already computed")
            return 0, False
        previous = self._pending.get(req_id)  # a re-call: not scheduled yet, or preempted and now resuming
        replaying = previous is not None and (previous.sent or previous.replay)
        if replaying and previous.outcome.get("status") == "fallback":
            # Its blend (or replay) failed and vLLM computed it plain: it stays plain, with that outcome (left
            # pending, vLLM's allocation hook would have taken it for a skipped load).
            self._pending.pop(req_id)
            self._fallbacks[req_id] = previous.outcome
            if previous.outcome.get("fused_before_preemption"):  # a replay failed: its resumption counts
                self._resumed_plain.add(req_id)  # when vLLM admits it (a failed first blend is plain all along)
            return 0, False
        if req_id not in self._budget.req_ids:
            if self._budget.req_ids and self._budget.tokens + len(prompt) > self.config.max_blend_tokens_per_step:
                if previous is None:  # what it says if it ends (aborted) before a step has room for it
                    self._fallbacks.setdefault(req_id, {
                        "status": "not_run", "detail": "deferred by max_blend_tokens_per_step; the request "
                                                       "finished before its blend ran"})
                return None, False  # over this step's blend budget: retried next step
            self._budget.req_ids.add(req_id)
            self._budget.tokens += len(prompt)
        if replaying:
            return self._replay(req_id, previous, prompt)
        keys = [chunk_key(prompt[s:e], self.key_context, at_prompt_start=s == 0) for s, e in fusion.chunks]
        admission = None if fusion.store_variant else Admission.from_config(self.config)
        variants = plan_variants(self.index, keys, [s == 0 for s, _ in fusion.chunks],
                                 [e - s for s, e in fusion.chunks], self.config.cachecraft_alpha,
                                 admission, self.config.max_variant_prefix_chunks)
        if fusion.store_variant:  # the chunk is a hole whatever is stored: saved as its prefix's variant
            variants[-1] = None
        indexed = [choice is not None for choice in variants]
        controller = None
        if self.config.ratio_mode == "controller":
            controller = self._decide(req_id, fusion, len(prompt), variants)
            if not controller["fuse"]:
                self._fall_back(req_id, "no_go", detail=controller["reason"])
                return 0, False
            fusion = dataclasses.replace(fusion, recompute_ratio=controller["ratio"])
        outcome = {"status": "planned", "selector": fusion.selector, "recompute_ratio": fusion.recompute_ratio,
                   "chunks": len(keys), "chunks_indexed": sum(indexed)}
        if controller is not None:
            outcome["controller"] = controller
        # idempotent: a re-call replaces it
        self._pending[req_id] = _Pending(request=fusion, token_ids=prompt, outcome=outcome, variants=variants)
        self._fallbacks.pop(req_id, None)  # it fell back at an earlier call (e.g. no_go): no longer its outcome
        return len(prompt) - 1, False

    def _replay(self, req_id: str, previous: _Pending, prompt: list[int]) -> tuple[int, bool]:
        """A request whose blend ran and that vLLM preempted and now resumes: its first blend's plan again,
        the same variants (its own saved holes stay holes), selector and ratio, with no controller (no
        no-go), so the K/V vLLM decodes the rest over are the ones its first tokens came from. Planned
        afresh from today's index, the holes it saved became hits and the rows went elsewhere: another
        answer than the same request unpreempted. Chunks the last blend did not load (a miss, a load timeout,
        another rank's miss) are computed in full again, whatever the store holds now. The worker neither
        saves nor counts the replay, and says whether it loaded every chunk it was sent to (`replay_exact`).
        The preemption is counted when the replay is sent (a request asked again and then aborted never
        resumed). Only the first blend's prompt is replayed: a streaming-input session grows its prompt in
        place between turns, and vLLM recomputes the later turns over the replayed K/V."""
        planned = len(previous.token_ids)
        if prompt[:planned] != previous.token_ids:  # not the prompt it blended: no K/V to rebuild
            self._pending.pop(req_id)
            previous.outcome.update(status="fallback", fallback_reason="replay_prompt_changed",
                                    detail="resumed with another prompt than the one blended",
                                    fused_before_preemption=True)
            self._fallbacks[req_id] = previous.outcome
            self._resumed_plain.add(req_id)
            return 0, False
        if previous.sent:  # the first re-call after a blend ran: replay what that blend loaded
            loaded = previous.outcome.get("chunks_loaded")
            if isinstance(loaded, list) and len(loaded) == len(previous.variants):
                previous.variants = [v if hit else None for v, hit in zip(previous.variants, loaded, strict=True)]
            previous.sent, previous.replay, previous.block_ids = False, True, None
        self._fallbacks.pop(req_id, None)
        return planned - 1, False

    def _decide(self, req_id: str, fusion: FusionRequest, num_tokens: int,
                variants: list[VariantChoice | None]) -> dict[str, Any]:
        """The loading controller's choice for one request, from the worker's measured figures: each
        chunk's load priced at the tiers the index knows hold it, rows as the selector will pick them."""
        figures = self.figures
        samples = figures.get("samples", {})
        if not figures.get("tiers") or not samples.get("blend_layers") or not samples.get("prefill_steps"):
            return {"fuse": True, "ratio": fusion.recompute_ratio,
                    "reason": "no measured figures yet (tier bandwidth, blend and prefill speed): fixed ratio"}
        num_layers, bytes_per_token = self._kv_geometry()
        loaded = [(e - s, s == 0, c) for (s, e), c in zip(fusion.chunks, variants, strict=True) if c is not None]
        loaded_tokens = sum(n for n, _, _ in loaded)
        tiers = [TierFigures(name, bps) for name, bps in figures["tiers"].items()]
        selector = make_selector(fusion.selector, self.config)
        rows = selector.estimate_rows([PlannedChunk(n, c.cfo) for n, system, c in loaded if not system], num_layers)
        probe = selector.probe_spec(num_layers)
        shape = RequestShape(
            num_tokens=num_tokens, num_layers=num_layers, num_full_layers=selector.num_full_layers(num_layers),
            num_candidates=sum(n for n, system, _ in loaded if not system), num_forced=num_tokens - loaded_tokens,
            bytes_to_load=loaded_tokens * bytes_per_token,
            bytes_by_tier=tier_bytes([(n * bytes_per_token, c.tiers) for n, _, c in loaded], tiers),
            num_planned_rows=rows.num_planned_rows, num_ratio_candidates=rows.num_ratio_candidates,
            num_probe_layers=0 if probe is None else probe.depth)
        decision = decide(shape, ComputeFigures(**figures["compute"]), tiers, r_min=fusion.recompute_ratio,
                          r_max=max(self.config.max_recompute_ratio, fusion.recompute_ratio),
                          ratio_mode="controller", fixed_ratio=fusion.recompute_ratio,
                          force_fuse=self.config.force_fuse, margin=self.config.controller_margin)
        return self._remeasure(req_id, decision)

    def _remeasure(self, req_id: str, decision: Any) -> dict[str, Any]:
        """The decision, or, for a no-go bound by the load of a tier that has lasted FIGURE_STALE_S, a go for
        this one request: only blends update a tier's figure, so one slow first read (the figure is seeded
        by it) kept every request of that tier at no-go for good, the tier never read again. The worker
        reseeds a figure that old with its next read, so this request's load replaces it."""
        if req_id in self._remeasuring:
            return self._remeasuring[req_id]
        out = dataclasses.asdict(decision)
        tier = decision.tier
        if tier is None:
            return out
        if decision.fuse:
            self._no_go_since.pop(tier, None)  # read by this blend: its figure is current
            return out
        if decision.est_load_s < decision.est_recompute_s:
            return out  # recompute-bound: a new measurement of the tier would not change it
        now = self.clock()
        since = self._no_go_since.setdefault(tier, now)
        if now - since >= FIGURE_STALE_S:
            self._no_go_since[tier] = now
            out.update(fuse=True, reason=f"re-measure (load-bound no-go on {tier} for {FIGURE_STALE_S:g} s, its "
                                         f"figure unread since): fused anyway; {decision.reason}")
            self._remeasuring[req_id] = out
        return out

    def _kv_geometry(self) -> tuple[int, int]:
        """(layers, stored K/V bytes per token over all layers, this rank's heads)."""
        hf = self._model_config.hf_text_config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        kv_heads = max(1, hf.num_key_value_heads // self._tp_size)
        itemsize = torch.empty(0, dtype=self._model_config.dtype).element_size()
        return hf.num_hidden_layers, 2 * kv_heads * head_dim * itemsize * hf.num_hidden_layers

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if request.request_id in self._resumed_plain:  # admitted again after its blend ran: a resumption
            self._resumed_plain.discard(request.request_id)
            outcome = self._fallbacks.get(request.request_id)
            if outcome is not None:
                self._count_resumption(outcome)
        pending = self._pending.get(request.request_id)
        if pending is None:
            return
        if num_external_tokens == 0:  # vLLM skipped the load (e.g. prompt_logprobs): plain output
            self._pending.pop(request.request_id)
            detail = "vLLM did not load external tokens (prompt_logprobs or skip_reading_prefix_cache)"
            if pending.replay:  # resumed, and the rest decoded plain: the earlier tokens were fused
                pending.outcome.update(status="fallback", fallback_reason="load_skipped_by_vllm", detail=detail,
                                       fused_before_preemption=True)
                self._count_resumption(pending.outcome)
                self._fallbacks[request.request_id] = pending.outcome
                return
            self._fall_back(request.request_id, "load_skipped_by_vllm", detail=detail)
            return
        pending.block_ids = list(blocks.get_block_ids()[0])

    def _count_resumption(self, outcome: dict[str, Any]) -> None:
        """One more time vLLM preempted the request after its blend ran and admitted it again."""
        outcome["preemptions"] = outcome.get("preemptions", 0) + 1
        self.counters["requests_replanned_after_preemption"] += 1

    def build_connector_meta(self, scheduler_output: Any) -> CacheFuseMetadata:
        plans = []
        block_ids_of = _scheduled_block_ids(scheduler_output)
        for req_id, pending in self._pending.items():
            if pending.sent or req_id not in block_ids_of:
                continue
            pending.sent = pending.figures_due = True
            if pending.replay:  # resumed after a preemption: counted when its replay goes out
                self._count_resumption(pending.outcome)
            plans.append(self._blend_plan(req_id, pending, block_ids_of[req_id]))
        self._budget = _StepBudget()
        return CacheFuseMetadata(plans=plans, plain_prefill_tokens=_plain_prefill_tokens(scheduler_output, plans))

    def _blend_plan(self, req_id: str, pending: _Pending, block_ids: list[int]) -> BlendPlan:
        depth = None
        if self.config.preload_depth is None:  # derived: the controller's L_p when it decided
            depth = (pending.outcome.get("controller") or {}).get("preload_depth")
        num_tokens, bs = len(pending.token_ids), self.block_size
        slots = [block_ids[p // bs] * bs + p % bs for p in range(num_tokens)]
        fusion = pending.request
        num_hit_blocks = (num_tokens - 1 + bs - 1) // bs
        return BlendPlan(
            req_id=req_id, token_ids=pending.token_ids, chunks=list(fusion.chunks), selector=fusion.selector,
            recompute_ratio=fusion.recompute_ratio, slot_mapping=slots,
            block_ids=block_ids[: (num_tokens + bs - 1) // bs], error_block_ids=block_ids[:num_hit_blocks],
            selected_rows=fusion.selected_rows, preload_depth=depth, variants=pending.variants,
            sync_save=fusion.sync_save, replay=pending.replay)

    # ------------------------------------------------------------------ outcomes

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, CacheFuseWorkerMeta):
            # Announced: saved behind the response, perhaps not written yet; kept across index reloads
            # until the worker reports them written (written_keys) and a reload has seen them.
            self.index.announce([record_from_dict(data) for data in meta.saved_variants], meta.saved_keys)
            for variant_id in meta.evicted_variants:
                self.index.remove(variant_id)
            self.index.confirm_written(meta.written_keys)
            self.counters["save_failures"] += meta.save_failures
            if meta.figures is not None:
                self.figures = meta.figures
            for req_id, figures in meta.request_stats.items():
                self._record_blend(req_id, figures)
        for req_id, outcome in self._awaiting.items():  # figures of a blend arrive in the step that ran it, or never
            if outcome.get("status") == "planned":
                outcome.update(status="not_run", detail="no figures came back from the worker for its blend")
                self._finish(req_id, outcome)
        self._awaiting.clear()

    def _record_blend(self, req_id: str, figures: dict[str, Any]) -> None:
        """One blend's figures: its events counted now, its request's outcome filled in place (and counted
        once the request has finished: a preempted request is blended again)."""
        for miss, count in (figures.get("miss_reasons") or {}).items():
            self.counters[f"miss:{miss}"] += count
        self.counters["save_failures"] += figures.get("save_failures", 0)
        self.counters["saves_skipped"] += figures.get("saves_skipped", 0)
        finished = self._awaiting.pop(req_id, None)
        pending = self._pending.get(req_id)
        outcome = finished if finished is not None else pending.outcome if pending is not None else None
        if outcome is None:
            return
        if pending is not None:
            pending.figures_due = False
        if outcome.get("preemptions"):  # a replay's figures
            figures = {**figures, **_replay_outcome(figures)}
            if "replay_exact" in outcome:  # inexact once, inexact for good: earlier tokens saw the older K/V
                figures["replay_exact"] = bool(outcome["replay_exact"] and figures.get("replay_exact", True))
        outcome.update(figures)
        if finished is not None:
            self._finish(req_id, finished)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        pending = self._pending.pop(req_id, None)
        fallback = self._fallbacks.pop(req_id, None)  # all dropped: nothing outlives the request, whatever its path
        self._resumed_plain.discard(req_id)
        self._remeasuring.pop(req_id, None)
        outcome = pending.outcome if pending is not None else fallback
        if outcome is None:
            return False, None
        if pending is not None and pending.sent and pending.figures_due:
            # vLLM frees a request finished in a step before it hands the connector that step's worker
            # output: the figures of the blend (or replay) that ran in it fill (and count) it in place
            self._awaiting[req_id] = outcome
            return False, {PARAMS_KEY: outcome}
        if pending is not None and outcome.get("status") == "planned":
            # planned, never scheduled: aborted, or stopped while waiting (e.g. after a preemption)
            outcome.update(status="not_run", detail="the request finished before its blend ran")
        self._finish(req_id, outcome)  # a fallback decided here, or a blend whose figures came in an earlier step
        return False, {PARAMS_KEY: outcome}

    def _finish(self, req_id: str, outcome: dict[str, Any]) -> None:
        """A finished request's final outcome, counted and logged once (`not_run` counts as neither)."""
        status = outcome.get("status")
        if status == "fused":
            self.counters["requests_fused"] += 1
            self._stats.record(requests_fused=1)
        elif status == "fallback":
            reason = outcome.get("fallback_reason")
            self.counters["requests_fallback"] += 1
            self.counters[f"fallback:{reason}"] += 1
            self._stats.record(**{"requests_fallback": 1, f"fallback_{reason}": 1})
        _log_outcome(req_id, outcome)

    def _fall_back(self, req_id: str, reason: str, *, detail: str, field: str | None = None) -> None:
        outcome = {"status": "fallback", "fallback_reason": reason, "detail": detail}
        if field is not None:
            outcome["field"] = field
        previous = self._fallbacks.get(req_id)
        self._fallbacks[req_id] = outcome  # counted when the request finishes: vLLM may ask again, or plan it
        self._pending.pop(req_id, None)
        if previous != outcome:  # vLLM asks again every step the request waits for blocks: say it once
            logger.info("cachefuse: request %s runs as plain vLLM (%s: %s)", req_id, reason, detail)

    def get_kv_connector_stats(self) -> CacheFuseConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, CacheFuseConnectorStats()
        return stats

    @property
    def _tokenize(self) -> Any:
        """`chunk_texts`' tokenizer (a chunk tokenized on its own), or None when none could be loaded."""
        if self._tokenizer is None:
            return None
        return lambda text: tokenize_piece(self._tokenizer, text)


def _replay_outcome(figures: dict[str, Any]) -> dict[str, Any]:
    """What a replay that failed adds to its request's outcome: its earlier tokens were fused (a replay
    that ran says itself whether it was exact: `replay_exact`, from the worker)."""
    if figures.get("status") == "fallback":
        return {"fused_before_preemption": True, "replay_exact": False}
    return {}


def _log_outcome(req_id: str, outcome: dict[str, Any]) -> None:
    """Every request's outcome, once, at DEBUG: also for responses that cannot carry it (a stop string ends
    a request in vLLM's front end before the engine's request_finished; streamed chunks are sent before)."""
    if logger.isEnabledFor(logging.DEBUG):
        fields = ("status", "fallback_reason", "chunks_hit", "chunks_missed", "tokens_reused", "tokens_recomputed",
                  "blend_time_s", "preemptions")
        logger.debug("cachefuse: request %s outcome %s", req_id,
                     {name: outcome[name] for name in fields if outcome.get(name) is not None})


def _load_tokenizer(source: Any) -> Any:
    """The model's tokenizer, for requests that declare `chunk_texts`; None (those requests then run plain,
    saying why) when it cannot be loaded: token offsets need none."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # noqa: BLE001 - serving offsets must not depend on it
        logger.warning("cachefuse scheduler: no tokenizer for chunk_texts (%s: %s); requests that send "
                       "chunk_texts run as plain vLLM", type(exc).__name__, exc)
        return None

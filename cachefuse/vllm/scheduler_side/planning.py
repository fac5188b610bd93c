"""Plans: which requests fuse, with which variants and ratio, within a step's blend budget, and the
BlendPlans sent to the worker; replays after preemption.

Imports cachefuse.chunks, cachefuse.metadata.index, cachefuse.request and the scheduler's gate and
outcomes; cachefuse.vllm.messages for BlendPlan (which loads vllm, so this module is not torch-free).
Each declared chunk's variant is chosen here by CFO from the scheduler's index and sent in the plan
(advisory: the worker re-checks every entry when it loads).

Preemption: vLLM frees a preempted request's blocks and, when it resumes it, asks again how many
tokens the connector holds. The request is planned again (`preemptions` counts how often) and its
plan is sent with the new block table, which vLLM lists under the cached requests
(`resumed_req_ids`), not the new ones: the blend writes [0, N-1) again before vLLM recomputes the
rest. Without that plan vLLM would decode over blocks nothing wrote.

vLLM's prefix cache (on by default): vLLM asks with its own hit, `num_computed_tokens` (block-aligned,
exact K/V computed plain by vLLM and shared with other requests). The blend then holds [P, N-1) only: its
pass computes the whole prompt in memory as ever, but never writes or reads the hit's slots
(`cached_prefix_tokens`, paged.unwritten_prefix). The hooks salt the request's block hashes from P on
(block_hashes.py), so nobody else is ever served its blended blocks. A prompt vLLM holds whole (N-1 tokens
or more) runs as plain vLLM; a resumed fused request that finds its own blended blocks resumes over them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cachefuse.chunks import KeyContext, chunk_key, place_hashes
from cachefuse.config import CacheFuseConfig
from cachefuse.metadata.index import Admission, VariantChoice, VariantIndex, plan_variants
from cachefuse.request import FusionRequest
from cachefuse.vllm.messages import NULL_BLOCK_ID, BlendPlan, blend_budget_rows, estimated_rows
from cachefuse.vllm.scheduler_side.gate import Gate
from cachefuse.vllm.scheduler_side.outcomes import Outcomes, RequestOutcome


@dataclass
class _Pending:
    request: FusionRequest
    token_ids: list[int]
    outcome: RequestOutcome
    chunk_keys: tuple[str, ...]
    """Rank 0's store key of each declared chunk, as planned (a replay sends them again)."""
    variants: list[VariantChoice | None] = field(default_factory=list)
    block_ids: list[int] | None = None
    sent: bool = False
    replay: bool = False
    """Preempted after its blend ran: the next blend replays this plan (Planner._replay)."""
    figures_due: bool = False
    """Its plan was sent and the worker's figures for it have not arrived yet."""
    load_async: bool = False
    """vLLM waits for the worker to report its blend (Planner.plan decides, per call)."""
    estimated_rows: float = 0.0
    """Its pass's rows summed over layers (messages.estimated_rows), estimated when it is (re)planned."""
    cached_prefix: int = 0
    """vLLM's own prefix-cache hit when it was (re)planned: the blend holds [cached_prefix, N-1)."""
    first_token_scheduled: bool = False
    """An asynchronous load whose blend ended and whose first token vLLM has scheduled (counted once)."""


@dataclass
class _StepBudget:
    tokens: int = 0
    req_ids: set[str] = field(default_factory=set)
    sync_rows: float = 0.0
    """Estimated pass rows of the blends this step runs synchronously (before its forward)."""


def _plain_prefill_tokens(scheduler_output: Any, plans: list[BlendPlan], blended: set[str]) -> int:
    """Tokens of a step made of one new, unfused prefill and nothing else (0 otherwise): a clean timing
    sample of a prompt of that length. A batch of k prompts costs k n^2 in attention, not (k n)^2: timed
    as one prompt of their summed tokens, it had fitted the quadratic term ~k times too small."""
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    new_ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
    if plans or len(scheduled) != 1 or set(scheduled) != new_ids or new_ids & blended:
        return 0  # (blended: an asynchronous load's last token, scheduled once its blend is done)
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


class Planner:
    """The plans of the requests vLLM has asked about and not yet finished, and this step's blend budget."""

    def __init__(self, config: CacheFuseConfig, *, block_size: int, key_context: KeyContext, index: VariantIndex,
                 gate: Gate, outcomes: Outcomes, num_layers: int, max_num_batched_tokens: int,
                 async_scheduling: bool = False) -> None:
        self.config = config
        self.async_scheduling = async_scheduling
        self.block_size = block_size
        self.num_layers = num_layers
        self.max_num_batched_tokens = max_num_batched_tokens
        self.key_context = key_context
        self.index = index
        self.gate = gate
        self.outcomes = outcomes
        self.pending: dict[str, _Pending] = {}
        self.budget = _StepBudget()

    def _loads_async(self, pending: _Pending) -> bool:
        """Whether the request's blend runs as vLLM's asynchronous load (batched with the others waiting,
        split across steps by `blend_step_tokens`), or synchronously, whole, before this step's forward,
        its first token out of this very step: only when no older blend is waiting or running (they go
        first) and this step's synchronous blends, this one included, fit the step's budget. With
        `blend_step_tokens: 0`, always synchronous. Estimates the pass's rows first (sent in its plan)."""
        from cachefuse.select.registry import (
            make_selector,  # select/ imports torch: only when a blend is planned
        )

        fusion = pending.request
        selector = make_selector(fusion.selector, self.config)
        probe = selector.probe_spec(self.num_layers)
        pending.estimated_rows = estimated_rows(len(pending.token_ids), fusion.segments, pending.variants,
                                                fusion.recompute_ratio, self.num_layers,
                                                selector.num_full_layers(self.num_layers),
                                                0 if probe is None else probe.depth, self.gate.blend_figures())
        if self.async_scheduling:
            # vLLM has scheduled the request's next step before it hears of a synchronous load's failure, and
            # vLLM 0.32 cannot recompute it then (the engine dies); an asynchronous load's failure is known
            # before the request is ever scheduled, and vLLM recomputes it as with any other transfer.
            return True
        if self.config.blend_step_tokens == 0:
            return False
        # An older asynchronous blend still waiting or running, or one that ended whose first token vLLM has
        # not scheduled yet (it waits ahead in vLLM's queue, so this step computes it): a synchronous blend
        # here would run before this step's forward, and those first tokens would wait for it.
        if any(p.load_async and (not p.sent or not p.first_token_scheduled)
               for p in self.pending.values() if p is not pending):
            return True
        step_rows = blend_budget_rows(self.config.blend_step_tokens, self.max_num_batched_tokens, self.num_layers)
        if self.budget.sync_rows + pending.estimated_rows > step_rows:
            return True
        self.budget.sync_rows += pending.estimated_rows
        return False

    def fall_back(self, req_id: str, reason: str, *, detail: str, field: str | None = None) -> None:
        """The request runs as plain vLLM, saying why: its plan, if any, is dropped."""
        self.outcomes.fall_back(req_id, reason, detail=detail, field=field)
        self.pending.pop(req_id, None)

    def plan(self, req_id: str, fusion: FusionRequest, prompt: list[int],
             num_computed_tokens: int) -> tuple[int | None, bool]:
        """The plan of one parsed request (or its fallback): variants, budget, the controller's ratio.

        Returns:
            vLLM's `get_num_new_matched_tokens` answer: tokens held ([0, N-1) when fused, 0 when plain,
            None when over this step's blend budget: asked again next step), and whether the load is
            asynchronous (`_loads_async`: vLLM waits for the worker to report the blend done).
        """
        previous = self.pending.get(req_id)  # a re-call: not scheduled yet, or preempted and now resuming
        replaying = previous is not None and (previous.sent or previous.replay)
        if replaying and previous.outcome.status == "fallback":
            # Its blend (or replay) failed and vLLM computed it plain: it stays plain, with that outcome (left
            # pending, vLLM's allocation hook would have taken it for a skipped load).
            self.pending.pop(req_id)
            self.outcomes.fallbacks[req_id] = previous.outcome
            if previous.outcome.fused_before_preemption:  # a replay failed: its resumption counts
                self.outcomes.resumed_plain.add(req_id)  # when vLLM admits it (a failed first blend is plain all along)
            return 0, False
        if num_computed_tokens >= len(prompt) - 1:  # vLLM's prefix cache holds every token a blend would write
            if replaying and prompt[:len(previous.token_ids)] == previous.token_ids:
                return self._resume_cached(req_id, previous)
            self.fall_back(req_id, "local_prefix_hit", detail=f"vLLM's prefix cache holds {num_computed_tokens} of "
                           f"the prompt's {len(prompt)} tokens: plain vLLM output, nothing to blend")
            return 0, False
        if not self._within_budget(req_id, previous is None, len(prompt)):
            return None, False  # over this step's blend budget: retried next step
        if replaying:
            return self._replay(req_id, previous, prompt, num_computed_tokens)
        return self._plan_new(req_id, fusion, prompt, num_computed_tokens)

    def _resume_cached(self, req_id: str, previous: _Pending) -> tuple[int, bool]:
        """A fused request vLLM preempted and resumes, finding its own blended blocks in its prefix cache (its
        salted chain: nobody else's): it resumes over the very K/V its first tokens came from, nothing to
        blend. Counted as a resumption, exact like a replay that loaded everything."""
        previous.sent, previous.replay, previous.block_ids = True, False, None  # no plan goes out
        self.outcomes.fallbacks.pop(req_id, None)
        self.outcomes.count_resumption(previous.outcome)
        previous.outcome.update(replay_exact=previous.outcome.replay_exact is not False)
        return 0, False

    def _within_budget(self, req_id: str, first_call: bool, num_tokens: int) -> bool:
        """Counts the request against this step's `max_blend_tokens_per_step`, or says it must wait: a step
        always admits one request, however long."""
        if req_id in self.budget.req_ids:
            return True
        if self.budget.req_ids and self.budget.tokens + num_tokens > self.config.max_blend_tokens_per_step:
            if first_call:  # what it says if it ends (aborted) before a step has room for it
                self.outcomes.fallbacks.setdefault(req_id, RequestOutcome(
                    status="not_run", detail="deferred by max_blend_tokens_per_step; the request finished "
                                             "before its blend ran"))
            return False
        self.budget.req_ids.add(req_id)
        self.budget.tokens += num_tokens
        return True

    def _plan_new(self, req_id: str, fusion: FusionRequest, prompt: list[int],
                  cached_prefix: int) -> tuple[int, bool]:
        """A first plan: each chunk's variant from the index, and the controller's go/no-go and ratio."""
        keys = [chunk_key(prompt[s:e], self.key_context, at_prompt_start=s == 0) for s, e in fusion.chunks]
        admission = None if fusion.store_variant else Admission.from_config(self.config)
        variants = plan_variants(self.index, keys, [s == 0 for s, _ in fusion.chunks],
                                 [e - s for s, e in fusion.chunks], self.config.cachecraft_alpha,
                                 admission, self.config.max_variant_prefix_chunks,
                                 place_hashes(prompt, [s for s, _ in fusion.chunks]) if self.config.exact_places
                                 else None, self.config.default_variant)
        if fusion.store_variant:  # the chunk is a hole whatever is stored: saved as its prefix's variant
            variants[-1] = None
        indexed = [choice is not None for choice in variants]
        controller = None
        if self.config.ratio_mode == "controller":
            controller = self.gate.decide(req_id, fusion, len(prompt), variants, cached_prefix)
            if not controller["fuse"]:
                self.fall_back(req_id, "no_go", detail=controller["reason"])
                return 0, False
            fusion = dataclasses.replace(fusion, recompute_ratio=controller["ratio"])
        outcome = RequestOutcome(status="planned", selector=fusion.selector, recompute_ratio=fusion.recompute_ratio,
                                 chunks=len(keys), chunks_indexed=sum(indexed), controller=controller)
        # idempotent: a re-call replaces it
        self.pending[req_id] = _Pending(request=fusion, token_ids=prompt, outcome=outcome, chunk_keys=tuple(keys),
                                        variants=variants, cached_prefix=cached_prefix)
        self.outcomes.fallbacks.pop(req_id, None)  # it fell back at an earlier call (e.g. no_go): no longer its outcome
        pending = self.pending[req_id]
        pending.load_async = self._loads_async(pending)
        return len(prompt) - 1 - cached_prefix, pending.load_async

    def _replay(self, req_id: str, previous: _Pending, prompt: list[int], cached_prefix: int) -> tuple[int, bool]:
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
            self.pending.pop(req_id)
            previous.outcome.update(status="fallback", fallback_reason="replay_prompt_changed",
                                    detail="resumed with another prompt than the one blended",
                                    fused_before_preemption=True)
            self.outcomes.fallbacks[req_id] = previous.outcome
            self.outcomes.resumed_plain.add(req_id)
            return 0, False
        if previous.sent:  # the first re-call after a blend ran: replay what that blend loaded
            loaded = previous.outcome.figures.get("chunks_loaded")
            if isinstance(loaded, list) and len(loaded) == len(previous.variants):
                previous.variants = [v if hit else None for v, hit in zip(previous.variants, loaded, strict=True)]
            previous.sent, previous.replay, previous.block_ids = False, True, None
            previous.first_token_scheduled = False  # the replay's first forward is due again
        self.outcomes.fallbacks.pop(req_id, None)
        previous.cached_prefix = cached_prefix  # exact blocks, or its own blended ones found again
        previous.load_async = self._loads_async(previous)
        return planned - 1 - cached_prefix, previous.load_async

    def allocated(self, req_id: str, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks (`blocks`: its KVCacheBlocks), loading `num_external_tokens`."""
        self.outcomes.admitted(req_id)
        pending = self.pending.get(req_id)
        if pending is None or pending.sent:
            # sent: an asynchronous load vLLM now schedules (it allocates again, loading nothing more)
            return
        if num_external_tokens == 0:  # vLLM skipped the load (e.g. prompt_logprobs): plain output
            self.pending.pop(req_id)
            detail = "vLLM did not load external tokens (prompt_logprobs or skip_reading_prefix_cache)"
            if pending.replay:  # resumed, and the rest decoded plain: the earlier tokens were fused
                pending.outcome.update(status="fallback", fallback_reason="load_skipped_by_vllm", detail=detail,
                                       fused_before_preemption=True)
                self.outcomes.count_resumption(pending.outcome)
                self.outcomes.fallbacks[req_id] = pending.outcome
                return
            self.fall_back(req_id, "load_skipped_by_vllm", detail=detail)
            return
        pending.block_ids = list(blocks.get_block_ids()[0])

    def first_tokens(self, scheduler_output: Any) -> int:
        """Requests whose asynchronous blend ended and whose first token this step computes (each once):
        an asynchronous load is not scheduled until vLLM has its blend's report."""
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        count = 0
        for req_id in scheduled:
            pending = self.pending.get(req_id)
            if pending is not None and pending.load_async and pending.sent and not pending.first_token_scheduled:
                pending.first_token_scheduled = True
                count += 1
        return count

    def step_plans(self, scheduler_output: Any) -> tuple[list[BlendPlan], int]:
        """This step's BlendPlans (requests whose prompt it computes from scratch and whose plan has not
        gone out), and its plain prefill tokens; the step's budget starts over."""
        plans = []
        # A synchronous load's blocks are the step's (vLLM schedules its prompt now); an asynchronous one's
        # were allocated for it this step, and it waits in WAITING_FOR_REMOTE_KVS, not scheduled.
        block_ids_of = _scheduled_block_ids(scheduler_output)
        for req_id, pending in self.pending.items():
            block_ids = pending.block_ids if pending.load_async else block_ids_of.get(req_id)
            if pending.sent or block_ids is None:
                continue
            pending.sent = pending.figures_due = True
            if pending.replay:  # resumed after a preemption: counted when its replay goes out
                self.outcomes.count_resumption(pending.outcome)
            plans.append(self._blend_plan(req_id, pending, block_ids))
        self.budget = _StepBudget()
        blended = {req_id for req_id, pending in self.pending.items() if pending.sent}
        return plans, _plain_prefill_tokens(scheduler_output, plans, blended)

    def _blend_plan(self, req_id: str, pending: _Pending, block_ids: list[int]) -> BlendPlan:
        depth = None
        if self.config.preload_depth is None:  # derived: the controller's L_p when it decided
            depth = (pending.outcome.controller or {}).get("preload_depth")
        num_tokens, bs = len(pending.token_ids), self.block_size
        # an asynchronous load's blocks may stop at N-2: vLLM allocates N-1's slot when it computes it
        slots = [block_ids[p // bs] * bs + p % bs for p in range(min(num_tokens, len(block_ids) * bs))]
        fusion = pending.request
        num_hit_blocks = (num_tokens - 1 + bs - 1) // bs
        # vLLM's hit and its null block (a sliding-window model's blocks out of every window) are shared by
        # other requests: never reported as load errors
        cached_blocks = pending.cached_prefix // bs
        return BlendPlan(
            req_id=req_id, token_ids=pending.token_ids, segments=fusion.segments, chunk_keys=pending.chunk_keys,
            selector=fusion.selector,
            recompute_ratio=fusion.recompute_ratio, slot_mapping=slots,
            block_ids=block_ids[: (num_tokens + bs - 1) // bs],
            error_block_ids=[b for b in block_ids[cached_blocks:num_hit_blocks] if b != NULL_BLOCK_ID],
            selected_rows=fusion.selected_rows, preload_depth=depth, variants=pending.variants,
            sync_save=fusion.sync_save, replay=pending.replay, load_async=pending.load_async,
            # only an offline job's engine marks what it stores as the neighbour step's: a server's
            # store_variant request saves an ordinary variant, never one rule 8 loads everywhere
            neighbour_variant=fusion.store_variant and self.config.allow_sync_save,
            estimated_rows=pending.estimated_rows, cached_prefix_tokens=pending.cached_prefix)

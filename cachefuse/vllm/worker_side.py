"""The worker half of CacheFuseConnector: blend, write into vLLM's paged cache, save holes, report.

Runs in `start_load_kv`, before vLLM's forward of a step whose requests have synchronous hits.
For each planned request it runs the FusionEngine over the vLLM model's own modules
(VLLMAdapter), writes each layer's fused K/V into the request's slots as the pass goes, through the
attention layer's own `impl.do_kv_cache_update` (which handles every backend's paged layout;
cachefuse.vllm.paged), and stores holes. Any
exception is caught: the request's blocks are reported as load errors, so vLLM (with
kv_load_failure_policy="recompute", checked at start-up) recomputes it as a plain prefill.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from cachefuse.chunks import (
    KeyContext,
    dtype_name,
    model_fingerprint,
    paged_cache_dtype_name,
    resolve_model_dir,
)
from cachefuse.config import CacheFuseConfig
from cachefuse.errors import CacheFuseError, StoreError
from cachefuse.fusion.batch import Agreement, LayerDone, PassBatch
from cachefuse.fusion.engine import FusionEngine, RankGroup
from cachefuse.fusion.plan import FusePlan
from cachefuse.loading.figures import ComputeFigures, FigureRecorder, blend_cost_model
from cachefuse.loading.placement import FrequencyPlacement
from cachefuse.metadata.backends import open_config_metastore, open_metastore
from cachefuse.metadata.base import record_to_dict
from cachefuse.metadata.layer_profiles import with_profiled_layers
from cachefuse.select.fixed import FixedSelector
from cachefuse.select.registry import make_selector
from cachefuse.store.base import StoreIdentity
from cachefuse.store.tiered import open_store
from cachefuse.vllm.adapters import VLLMAdapter
from cachefuse.vllm.messages import BlendPlan, CacheFuseMetadata, CacheFuseWorkerMeta, blend_budget_rows
from cachefuse.vllm.metrics import CacheFuseConnectorStats
from cachefuse.vllm.paged import (
    PagedAttention,
    SlotWritingAttention,
    supports_paged_attention,
    unwritten_prefix,
)
from cachefuse.vllm.plugin import captured_model

logger = logging.getLogger(__name__)

# Per-layer samples and keys feed the figures and the scheduler's index, not the response.
_NOT_IN_RESPONSE = ("saved_keys", "loaded_keys", "layer_seconds", "layer_rows", "saved_variants", "evicted_variants")


class WorkerSide:
    def __init__(self, vllm_config: Any, config: CacheFuseConfig) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        model = captured_model(vllm_config, tp_rank)
        if model is None:
            raise CacheFuseError(
                "CacheFuseConnector found no loaded model in this worker: the cachefuse vLLM plugin did not "
                "run. Install cachefuse into vLLM's environment (its `vllm.general_plugins` entry point "
                "registers it), and if VLLM_PLUGINS is set, include 'cachefuse' in it")
        self.adapter = VLLMAdapter(model)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_rank = tp_rank  # rank 0 reports saved keys and counts requests' figures (see their uses)
        fingerprint = model_fingerprint(resolve_model_dir(vllm_config.model_config))
        shape = self.adapter.shape
        # QCFuse's critical layers from `cachefuse profile-layers`, stored beside the chunks (when not set)
        config = with_profiled_layers(config, config.store_path, fingerprint, shape.num_layers)
        self.config = config
        store = open_store(config.kv_store_path(tp_size, tp_rank), StoreIdentity(fingerprint, shape.num_layers, shape.dtype),
                           config.memory_capacity_bytes, config.disk_capacity_bytes, redis_url=config.redis_connection_url,
                           redis_timeout_s=config.redis_timeout_s, redis_capacity_bytes=config.redis_capacity_bytes,
                           device=self.adapter.device, device_capacity_bytes=config.device_capacity_bytes)
        key_context = KeyContext(fingerprint, dtype_name(shape.dtype), tp_size, tp_rank, config.compute_hash(),
                                 paged_cache_dtype_name(vllm_config.cache_config.cache_dtype, shape.dtype))
        # Rank 0 owns the variant metadata (in rank 0's keys, so the scheduler's plan names them); every
        # rank keeps its own K/V under its own keys.
        ranks = RankGroup(meta_key_context=dataclasses.replace(key_context, tp_rank=0), writes_metadata=tp_rank == 0)
        self.pass_agreement: Agreement | None = None
        if tp_size > 1:
            device = next(model.parameters()).device
            # Every rank scores only its own heads; summing makes all ranks pick the same rows. Every rank
            # loads its own heads: they agree on the hits before the pass. Every collective of a pass is an
            # op of its PassBatch (the model's and the pass's own sums), preceded by the agreement on
            # failures, so a pass failing on one rank fails on all before any rank enters the next one.
            ranks = dataclasses.replace(ranks, size=tp_size, sum_over_ranks=_sum_over_ranks)
            self.pass_agreement = _pass_agreement(device)
        self.engine = FusionEngine(self.adapter, store, key_context, config, metastore=_open_metastore(config),
                                   ranks=ranks)
        if config.save_holes and config.save_queue_bytes > 0:  # fsyncs and metadata writes leave the request's path
            self.engine.save_in_background(config.save_queue_bytes, config.save_flush_timeout_s)
        self.placement = None
        if config.placement == "frequency" and len(store.tiers) > 1:
            store.promote_on_hit = False
            self.placement = FrequencyPlacement(store, config.placement_hot, config.placement_cold,
                                                config.placement_half_life_s, time.monotonic)
        self.layer_names = [layer.self_attn.attn.layer_name for layer in model.model.layers]
        # Attention on the engine's own paged kernel where it is vLLM's CPU backend, else the fusor's
        # kernels (SlotWritingAttention); decided at the first blend, once vLLM's attention backends are set up.
        self.paged_attention: bool | None = None
        self.figures = FigureRecorder()
        self._prefill_step: tuple[int, float] | None = None  # (plain prefill tokens, start) of this step
        self._load_errors: set[int] = set()  # blocks of synchronous loads whose blend failed
        self._layer_cost: ComputeFigures | None = None
        """The measured blend cost model the step budget charges layers by (`_charge`), as the scheduler
        estimates passes by the same figures; None: rows (nothing measured yet, or several ranks)."""
        self._prices_layers = tp_size == 1
        # the blends waiting or running, oldest first
        self.passes = PassBatch(self.engine.fusor.execute_ops, self.pass_agreement, self._charge)
        self._running: dict[str, _Running] = {}
        self._finished_loads: set[str] = set()  # asynchronous loads done (or failed) since the last step
        self._failed_loads: set[str] = set()
        self.budget_rows = blend_budget_rows(config.blend_step_tokens,
                                             vllm_config.scheduler_config.max_num_batched_tokens, shape.num_layers)
        self._meta = CacheFuseWorkerMeta()
        self._stats = CacheFuseConnectorStats()
        self._reported_depth = None  # the save queue's depth as last reported (vllm.metrics: gauges)

    def start_load_kv(self, metadata: CacheFuseMetadata, forward_context: Any) -> None:
        """This step's blends: the synchronous ones whole (vLLM's forward reads their K/V next; batched
        together), then the waiting asynchronous ones, batched, oldest first, within what is left of the
        step's budget (`blend_step_tokens`), the rest resuming next step; none of them in a step that
        computes the first token of an asynchronous blend that ended (CacheFuseMetadata.first_tokens)."""
        for req_id in metadata.finished_req_ids:
            self._cancel(req_id)
        layers = forward_context.no_compile_layers
        now = PassBatch(self.engine.fusor.execute_ops, self.pass_agreement, self._charge)
        for plan in metadata.plans:
            self._start(plan, layers, self.passes if plan.load_async else now)
        spent = self._advance(now, None).rows if len(now) else 0
        # A step that computes first tokens of blends that ended earlier holds the waiting ones: those tokens
        # are sampled after the step's blend work, so running the next cohort here would add its whole blend
        # to their TTFT. Held for one step only (the next has no such tokens: no blend ended in this one).
        if len(self.passes) and self.budget_rows > spent and not metadata.first_tokens:
            self._advance(self.passes, self.budget_rows - spent)

    def _charge(self, done: LayerDone) -> float:
        """A finished layer's cost of the step budget: its measured cost in rows of a full layer (the
        figures last sent to the scheduler, which estimates passes by them), its rows before any blend is
        timed. Under tensor parallelism always its rows: each rank times its own work, and ranks whose
        charges differed would stop their batches at different layers, pairing their collectives wrong."""
        cost = self._layer_cost
        return float(done.rows) if cost is None else cost.row_equivalents(done.rows, done.keys)

    def _advance(self, batch: PassBatch, budget_rows: float | None) -> Any:
        advanced = batch.advance(budget_rows)
        for req_id, (_, stats) in advanced.finished.items():
            steps, batch_size = advanced.split[req_id]
            self._finish(self._running.pop(req_id), stats, steps, batch_size)
        for req_id, exc in advanced.failed.items():
            self._fail(self._running.pop(req_id), f"{type(exc).__name__}: {exc}")
        return advanced

    def _start(self, plan: BlendPlan, layers: dict[str, Any], batch: PassBatch) -> None:
        """Adds the plan's pass to `batch`; a plan that cannot start falls back at once."""
        try:
            steps = self._fuse_steps(plan, layers)
        except Exception as exc:  # noqa: BLE001 - one request never stops the engine: vLLM recomputes it
            self._fail(_Running(plan, time.perf_counter()), f"{type(exc).__name__}: {exc}")
            return
        self._running[plan.req_id] = _Running(plan, time.perf_counter())
        batch.add(plan.req_id, steps, plan.estimated_rows)

    def _cancel(self, req_id: str) -> None:
        """vLLM finished the request (an abort) while its blend waits or runs: stopped where it stands
        (pins and loader released) and reported done, so vLLM frees the blocks it held for it."""
        running = self._running.pop(req_id, None)
        if running is None:
            return
        self.passes.cancel(req_id)
        if running.plan.load_async:
            self._finished_loads.add(req_id)

    def _fail(self, running: _Running, detail: str) -> None:
        plan = running.plan
        logger.warning("cachefuse: blend of request %s failed (%s); vLLM recomputes it", plan.req_id, detail)
        if plan.load_async:
            self._failed_loads.add(plan.req_id)
            self._finished_loads.add(plan.req_id)
        else:
            self._load_errors.update(plan.error_block_ids)
        self._meta.request_stats[plan.req_id] = {"status": "fallback", "fallback_reason": "blend_error",
                                                 "detail": detail}

    def _num_full(self, selector: str) -> int:
        return make_selector(selector, self.config).num_full_layers(self.adapter.shape.num_layers)

    def _record_stats(self, figures: dict[str, Any]) -> None:
        """A blend's counters for Prometheus. vLLM sums the ranks' stats: a request's figures (chunks,
        tokens, time, holes saved, skipped or failed, steps and batch) are counted by rank 0 alone, the
        ones its response carries; the bytes each rank read (its own heads), and their time, by each."""
        self._stats.record(**{f"bytes_loaded_tier_{tier}": n for tier, n in figures["load_bytes_by_tier"].items()},
                           **{f"load_seconds_tier_{tier}": t for tier, t in figures["load_seconds_by_tier"].items()})
        if self.tp_rank != 0:
            self._stats.record(bytes_loaded=figures["bytes_loaded"])
            return
        self._stats.sample(blend_time_s=figures["blend_time_s"])
        self._stats.record(tokens_reused=figures["tokens_reused"], tokens_recomputed=figures["tokens_recomputed"],
                           bytes_loaded=figures["bytes_loaded"], blend_time_s=figures["blend_time_s"],
                           chunks_hit=figures["chunks_hit"], chunks_missed=figures["chunks_missed"],
                           exact_prefix_chunks=figures["exact_prefix_chunks"],
                           exact_prefix_tokens=figures["exact_prefix_tokens"],
                           holes_saved=figures["holes_saved"], saves_skipped=figures["saves_skipped"],
                           save_failures=figures["save_failures"], blend_steps=figures["blend_steps"],
                           blend_batch_size=figures["blend_batch_size"], blends_split=int(figures["blend_steps"] > 1),
                           blends_batched=int(figures["blend_batch_size"] > 1))

    def _fuse_steps(self, plan: BlendPlan, layers: dict[str, Any]) -> Any:
        """The plan's pass (FusionEngine.fuse_steps) over vLLM's own attention layers and the request's slots."""
        selector: Any = plan.selector
        if plan.selected_rows is not None:
            selector = FixedSelector(plan.selected_rows, self._num_full(plan.selector))
        first_cache = layers[self.layer_names[0]].kv_cache
        slot_mapping = torch.tensor(plan.slot_mapping, dtype=torch.int64, device=first_cache.device)
        if self.paged_attention is None:
            self.paged_attention = all(supports_paged_attention(layers[name]) for name in self.layer_names)
        fusor = self.engine.fusor
        paged_from = unwritten_prefix(plan.block_ids, self.block_size, plan.cached_prefix_tokens)
        if self.paged_attention:  # both write every layer's merged K/V into the slots as they attend
            backend = PagedAttention(layers, self.layer_names, slot_mapping,
                                     torch.tensor([plan.block_ids], dtype=torch.int32, device=first_cache.device),
                                     paged_from)
        else:
            backend = SlotWritingAttention(layers, self.layer_names, slot_mapping, self.adapter.shape.scaling,
                                           fusor.block_rows, fusor.attention_fn, windows=self.adapter.shape.layer_windows,
                                           paged_from=paged_from)
        # A replay (the request's first blend ran before a preemption) saved its holes and counted its
        # reuses the first time.
        return self.engine.fuse_steps(FusePlan(
            token_ids=plan.token_ids, segments=plan.segments, meta_keys=plan.chunk_keys, selector=selector,
            ratio=plan.recompute_ratio, variants=plan.variants, preload_depth=plan.preload_depth,
            save_holes=self.config.save_holes and not plan.replay, save_inline=plan.sync_save,
            neighbour_variant=plan.neighbour_variant,
            record_uses=not plan.replay, attention_backend=backend))

    def _finish(self, running: _Running, stats: Any, steps: int, batch_size: int) -> None:
        """A pass that ended: what it saved and evicted, its figures, placement, and the response's stats."""
        plan = running.plan
        self._meta.evict(stats.evicted_variants)
        # The scheduler plans in rank 0's keys: another rank's store keys would sit in its index for good,
        # matching no row.
        self._meta.announce(list(stats.saved_keys) if self.tp_rank == 0 else [],
                            [record_to_dict(r) for r in stats.saved_variants])
        if batch_size == 1:  # batched, a layer's time is the batch's: no sample of one request's speed
            self.figures.observe_blend(stats, len(plan.token_ids))
        # The entries read (a variant's key, not its chunk's plain key), once per request: not again on a replay.
        if self.placement is not None and not plan.replay:
            self.placement.record(stats.loaded_keys)
            for key, source, target in self.placement.apply():
                logger.debug("cachefuse placement: %s %s -> %s", key, source, target)
        figures = {key: value for key, value in stats.to_dict().items() if key not in _NOT_IN_RESPONSE}
        figures.update(status="fused", fallback_reason=None, inject_time_s=time.perf_counter() - running.start,
                       blend_steps=steps, blend_batch_size=batch_size,
                       prefix_cache_tokens=plan.cached_prefix_tokens)
        if plan.replay and plan.variants is not None:  # loaded exactly what the last blend loaded
            figures["replay_exact"] = stats.chunks_loaded == [v is not None for v in plan.variants]
        self._record_stats(figures)
        self._meta.request_stats[plan.req_id] = figures
        if plan.load_async:
            self._finished_loads.add(plan.req_id)

    def on_step_start(self, metadata: CacheFuseMetadata) -> None:
        """Before vLLM's forward: a step of plain prefills only is timed (vLLM's own prefill speed)."""
        tokens = metadata.plain_prefill_tokens if isinstance(metadata, CacheFuseMetadata) else 0
        self._prefill_step = (tokens, time.perf_counter()) if tokens else None

    def on_step_end(self) -> None:
        if self._prefill_step is not None:
            tokens, start = self._prefill_step
            if self.adapter.device.type == "cuda":
                # The forward has been launched, not run: without the wait this times kernel launches, and
                # the controller would think plain prefill far faster than the blend (timed by CUDA events).
                torch.cuda.synchronize(self.adapter.device)
            self.figures.observe_prefill(tokens, time.perf_counter() - start)
            self._prefill_step = None

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """(blends done, blends failed) since the last step, for vLLM's `get_finished`: each request once.
        A blend stopped for a request vLLM finished (start_load_kv, every step) is among the done."""
        done, failed = self._finished_loads, self._failed_loads
        self._finished_loads, self._failed_loads = set(), set()
        return done, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> CacheFuseWorkerMeta | None:
        if self.figures.changed:
            self._meta.figures = self.figures.snapshot()
            self.figures.changed = False
            if self._prices_layers:
                self._layer_cost = blend_cost_model(self._meta.figures)
        written = self.engine.take_save_report()  # background saves finished since the last step
        self._meta.evict(written.evicted)
        if self.tp_rank == 0:
            self._meta.written_keys.extend(written.written)
            if written.written:
                self._stats.record(saves_written=len(written.written))
        self._meta.save_failures += written.failures
        if written.failures:
            self._stats.record(save_failures=written.failures)
        if (not self._meta.request_stats and not self._meta.saved_keys and self._meta.figures is None
                and not self._meta.evicted_variants and not self._meta.save_failures
                and not self._meta.written_keys):
            return None
        meta, self._meta = self._meta, CacheFuseWorkerMeta()
        return meta

    def close(self) -> None:
        """Stops the blends still waiting, writes the queued hole saves (within `save_flush_timeout_s`), then
        closes the metadata store's connection (idempotent)."""
        self.passes.close()
        self.engine.close()
        self.engine.metastore.close()

    def get_kv_connector_stats(self) -> CacheFuseConnectorStats | None:
        depth = self.engine.save_queue_depth()
        if depth is not None and depth != self._reported_depth:  # a level: said when it changes
            self._stats.set_gauges(self.tp_rank, save_queue_holes=depth.num_saves, save_queue_bytes=depth.num_bytes,
                                   save_queue_capacity_bytes=depth.max_bytes)
            self._reported_depth = depth
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, CacheFuseConnectorStats()
        return stats


@dataclass
class _Running:
    """A blend the worker has started and not finished."""

    plan: BlendPlan
    start: float


def _open_metastore(config: CacheFuseConfig) -> Any:
    """The configured metadata store, or, when it cannot be opened (a corrupt, truncated, locked or
    unwritable meta.sqlite), one in memory for this run: the engine starts and serves, variants saved now
    are tracked until restart, and the K/V files stay readable (base variants need no metadata row).
    Redis down is not such a case: its store opens anyway and answers once Redis does."""
    try:
        return open_config_metastore(config)
    except StoreError as exc:
        logger.warning("cachefuse worker: variant metadata store unavailable (%s); tracking variants in memory "
                       "until restart. Fix or move the file away to keep them across restarts", exc)
        return open_metastore(None, max_variants=config.max_variants, policy=config.eviction_policy)


def _sum_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """RankGroup.sum_over_ranks over vLLM's tensor-parallel group (the passes' RankSum ops)."""
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(values)


def _pass_agreement(device: Any) -> Agreement:
    """PassBatch's agreement over vLLM's tensor-parallel group: one all-reduce (sum) of a failed flag per
    pass; a pass failed on any rank fails on all (cachefuse.fusion.batch)."""

    def agree(failed: list[bool]) -> list[bool]:
        flags = torch.tensor([float(f) for f in failed], dtype=torch.float32, device=device)
        return [count > 0 for count in _sum_over_ranks(flags).tolist()]

    return agree

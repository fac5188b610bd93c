"""SchedulerSide: vLLM's scheduler hooks of CacheFuseConnector, each converting vLLM's objects and calling
the planner (planning.py), the gate (gate.py) or the outcomes (outcomes.py).

Imports the scheduler's modules, cachefuse.request (parsing), cachefuse.metadata, and
cachefuse.vllm.{messages, metrics} (which load vllm). Runs inside vLLM's `Scheduler.schedule()` hot path:
no tensors, no network, no file reads per request. What a request's outcome says and when it is counted
is outcomes.py's docstring; preemption and replays are planning.py's.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from cachefuse.chunks import (
    PARAMS_KEY,
    KeyContext,
    dtype_name,
    model_fingerprint,
    paged_cache_dtype_name,
    resolve_model_dir,
)
from cachefuse.config import CacheFuseConfig
from cachefuse.errors import RequestError, RequestLimitError
from cachefuse.metadata.base import record_from_dict
from cachefuse.metadata.index import VariantIndex
from cachefuse.metadata.layer_profiles import with_profiled_layers
from cachefuse.rag_prompt import tokenize_piece
from cachefuse.redis_client import redact_url
from cachefuse.request import parse_request, wants_fusion
from cachefuse.vllm.messages import CacheFuseMetadata, CacheFuseWorkerMeta
from cachefuse.vllm.metrics import CacheFuseConnectorStats
from cachefuse.vllm.scheduler_side.block_hashes import BlendHashes
from cachefuse.vllm.scheduler_side.gate import Gate
from cachefuse.vllm.scheduler_side.index import start_index
from cachefuse.vllm.scheduler_side.outcomes import Outcomes
from cachefuse.vllm.scheduler_side.planning import Planner

logger = logging.getLogger(__name__)


class SchedulerSide:
    def __init__(self, vllm_config: Any, config: CacheFuseConfig) -> None:
        model_config = vllm_config.model_config
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.key_context = KeyContext(
            model_fingerprint(resolve_model_dir(model_config)), dtype_name(model_config.dtype),
            tp_size, 0, config.compute_hash(),
            paged_cache_dtype_name(vllm_config.cache_config.cache_dtype, model_config.dtype))
        # The worker's critical layers (a stored `cachefuse profile-layers`), for the probe's estimate
        config = with_profiled_layers(config, config.store_path, self.key_context.model_fingerprint,
                                      model_config.hf_text_config.num_hidden_layers)
        self.config = config
        self.index = VariantIndex()
        self._refresher = start_index(self.index, config, tp_size)
        self._tokenizer = _load_tokenizer(model_config.tokenizer)  # now, not inside the first schedule()
        self.outcomes = Outcomes(CacheFuseConnectorStats())
        self.gate = Gate(config, model_config, tp_size)
        self.planner = Planner(config, block_size=vllm_config.cache_config.block_size,
                               key_context=self.key_context, index=self.index, gate=self.gate,
                               outcomes=self.outcomes, num_layers=model_config.hf_text_config.num_hidden_layers,
                               max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                               async_scheduling=bool(vllm_config.scheduler_config.async_scheduling))
        cache_config = vllm_config.cache_config
        # vLLM's prefix cache on: blended blocks hashed apart from plain ones (block_hashes.py)
        self.hashes = (BlendHashes(cache_config.prefix_caching_hash_algo, cache_config.block_size)
                       if cache_config.enable_prefix_caching else None)
        logger.info("cachefuse scheduler: %d variants indexed (%s)", len(self.index),
                    redact_url(config.redis_url) if config.redis_url else config.store_path)

    @property
    def config(self) -> CacheFuseConfig:
        return self._config

    @config.setter
    def config(self, config: CacheFuseConfig) -> None:
        """One config for every part: replacing it (tests do, for one request) reaches the planner and gate."""
        self._config = config
        for part in (getattr(self, "planner", None), getattr(self, "gate", None)):
            if part is not None:
                part.config = config

    @property
    def counters(self) -> Counter[str]:
        """Requests fused and fallbacks by reason since start-up, and events (misses, save failures)."""
        return self.outcomes.counters

    @property
    def figures(self) -> dict[str, Any]:
        """The worker's latest measured figures (tiers' bytes/s, blend and prefill speed)."""
        return self.gate.figures

    @figures.setter
    def figures(self, figures: dict[str, Any]) -> None:
        self.gate.figures = figures

    def close(self) -> None:
        """Stops the index refresher (vLLM calls the connector's shutdown)."""
        if self._refresher is not None:
            self._refresher.stop()
            self._refresher = None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not wants_fusion(params, self.config):
            return 0, False
        req_id, prompt = request.request_id, list(request.prompt_token_ids or [])
        fallback = self.outcomes.fallbacks.get(req_id)
        if fallback is not None and getattr(request, "num_output_tokens", 0):
            # It ran as plain vLLM, was preempted and resumes: its tokens so far came from plain K/V, and a
            # blend now would decode the rest over other K/V (an answer neither plain nor fused).
            if fallback.fused_before_preemption:
                self.outcomes.resumed_plain.add(req_id)  # its resumption counts when vLLM admits it
            return 0, False
        try:
            fusion = parse_request(params, prompt, self.config, self._tokenize)
        except RequestLimitError as exc:
            self.planner.fall_back(req_id, "over_limit", detail=exc.reason, field=exc.field)
            return 0, False
        except RequestError as exc:
            self.planner.fall_back(req_id, "malformed_request", detail=exc.reason, field=exc.field)
            return 0, False
        except Exception as exc:  # noqa: BLE001 - a parser bug must not stop vLLM's scheduler step
            logger.exception("cachefuse: request %s: parsing its parameters failed unexpectedly", req_id)
            self.planner.fall_back(req_id, "malformed_request",
                                   detail=f"unexpected {type(exc).__name__} while parsing", field=PARAMS_KEY)
            return 0, False
        if fusion is None or not fusion.chunks:
            return 0, False
        try:
            num_tokens, load_async = self.planner.plan(req_id, fusion, prompt, num_computed_tokens)
            if num_tokens and self.hashes is not None:
                self.hashes.salt(request, num_computed_tokens // self.hashes.block_size)
            return num_tokens, load_async
        except Exception as exc:  # noqa: BLE001 - a planning bug (or a row no check caught) must not stop schedule()
            logger.exception("cachefuse: request %s: planning failed unexpectedly", req_id)
            self.planner.fall_back(req_id, "planning_error", detail=f"unexpected {type(exc).__name__} while planning")
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.planner.allocated(request.request_id, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> CacheFuseMetadata:
        first_tokens = self.planner.first_tokens(scheduler_output)  # before this step's plans go out
        plans, plain_prefill_tokens = self.planner.step_plans(scheduler_output)
        return CacheFuseMetadata(plans=plans, plain_prefill_tokens=plain_prefill_tokens,
                                 finished_req_ids=sorted(getattr(scheduler_output, "finished_req_ids", ())),
                                 first_tokens=first_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, CacheFuseWorkerMeta):
            # Announced: saved behind the response, perhaps not written yet; kept across index reloads
            # until the worker reports them written (written_keys) and a reload has seen them.
            self.index.announce([record_from_dict(data) for data in meta.saved_variants], meta.saved_keys)
            for variant_id in meta.evicted_variants:
                self.index.remove(variant_id)
            self.index.confirm_written(meta.written_keys)
            self.outcomes.counters["save_failures"] += meta.save_failures
            if meta.figures is not None:
                self.gate.figures = meta.figures
            for req_id, figures in meta.request_stats.items():
                pending = self.planner.pending.get(req_id)
                if pending is not None:
                    pending.figures_due = False
                self.outcomes.record_blend(req_id, figures, None if pending is None else pending.outcome)
        self.outcomes.end_step()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        pending = self.planner.pending.pop(req_id, None)  # all dropped: nothing outlives the request
        self.gate.forget(req_id)
        if pending is None:
            return False, self.outcomes.request_finished(req_id, None, figures_due=False)
        return False, self.outcomes.request_finished(req_id, pending.outcome,
                                                     figures_due=pending.sent and pending.figures_due)

    def get_kv_connector_stats(self) -> CacheFuseConnectorStats | None:
        if self.outcomes.stats.is_empty():
            return None
        stats, self.outcomes.stats = self.outcomes.stats, CacheFuseConnectorStats()
        return stats

    @property
    def _tokenize(self) -> Any:
        """`chunk_texts`' tokenizer (a chunk tokenized on its own), or None when none could be loaded."""
        if self._tokenizer is None:
            return None
        return lambda text: tokenize_piece(self._tokenizer, text)


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

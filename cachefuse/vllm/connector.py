"""CacheFuseConnector: vLLM's KVConnectorBase_V1 over cachefuse. Translates, never decides.

Configured through `kv_connector_extra_config` (the same fields as CacheFuseConfig; a
`config_file` key loads YAML first). One instance per role: the scheduler half plans in
`get_num_new_matched_tokens` (reporting [0, N-1) as a synchronous hit), the worker half fuses and
writes K/V in `start_load_kv`. See scheduler_side/ and worker_side.py.

    --kv-transfer-config '{"kv_connector": "CacheFuseConnector",
                           "kv_connector_module_path": "cachefuse.vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"selector": "cacheblend", "recompute_ratio": 0.15}}'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from cachefuse.config import CacheFuseConfig
from cachefuse.vllm.checks import check_engine
from cachefuse.vllm.messages import CacheFuseMetadata
from cachefuse.vllm.metrics import CacheFuseConnectorStats, CacheFusePromMetrics

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


class CacheFuseConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = CacheFuseConfig.from_dict(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        check_engine(vllm_config)
        self._scheduler = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from cachefuse.vllm.scheduler_side.hooks import SchedulerSide

            self._scheduler = SchedulerSide(vllm_config, self.config)
        else:
            from cachefuse.vllm.worker_side import WorkerSide

            self._worker = WorkerSide(vllm_config, self.config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a lost save is a future miss, never a wrong answer

    @property
    def counters(self):
        """Scheduler side: requests fused and fallbacks by reason since start-up."""
        return self._scheduler.counters

    @property
    def figures(self) -> dict[str, Any]:
        """Scheduler side: the worker's latest measured figures (the loading controller's inputs)."""
        return self._scheduler.figures

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> CacheFuseMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    # ------------------------------------------------------------------ worker side

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.on_step_start(connector_metadata)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        pass  # K/V are written through each attention layer's own do_kv_cache_update

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if isinstance(metadata, CacheFuseMetadata):  # every step: blends split across steps resume here
            self._worker.start_load_kv(metadata, forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # a synchronous load's blend finishes every write before the forward begins

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Blends of asynchronous loads that ended this step (done or failed: vLLM recomputes the failed)."""
        if self._worker is None:
            return KVConnectorTransferResults()
        done, failed = self._worker.transfer_results()  # finished requests were stopped in start_load_kv
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        pass  # holes are saved by the blend pass itself, RoPE-stripped

    def wait_for_save(self) -> None:
        if self._worker is not None:  # runs after vLLM's forward: ends the step's timing
            self._worker.on_step_end()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker else set()

    def build_connector_worker_meta(self):
        return self._worker.build_connector_worker_meta() if self._worker else None

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()

    # ------------------------------------------------------------------ stats

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._worker or self._scheduler
        return side.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return CacheFuseConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return CacheFusePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

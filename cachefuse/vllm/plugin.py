"""vLLM general plugin: registers CacheFuseConnector and captures the loaded model per engine.

vLLM calls `register()` in every process it starts (API server, engine core, workers), so it is
idempotent, touches no device, and does nothing beyond a registration and one method wrap. The
wrap of `Worker.load_model` keeps `model_runner.get_model()` for engines whose kv_transfer_config
names a cachefuse connector: no connector API hands the model to a connector.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "CacheFuseConnector"
CONNECTOR_MODULE = "cachefuse.vllm.connector"

# (engine instance id, tensor-parallel rank) -> the worker's model; weak so engines can be freed.
_MODELS: weakref.WeakValueDictionary[tuple[str, int], Any] = weakref.WeakValueDictionary()


def uses_cachefuse(vllm_config: Any) -> bool:
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None:
        return False
    return kv.kv_connector == CONNECTOR_NAME or (kv.kv_connector_module_path or "").startswith("cachefuse")


def engine_key(vllm_config: Any, tp_rank: int) -> tuple[str, int]:
    return (str(vllm_config.instance_id), int(tp_rank))


def captured_model(vllm_config: Any, tp_rank: int) -> Any | None:
    """The model the wrapped load_model kept for this engine and rank, or None."""
    return _MODELS.get(engine_key(vllm_config, tp_rank))


def register() -> None:
    """The `vllm.general_plugins` entry point."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # already registered in this process
        pass
    _wrap_load_model()


def _wrap_load_model() -> None:
    from vllm.v1.worker.gpu_worker import Worker  # the CPU worker inherits load_model from it

    if getattr(Worker.load_model, "_cachefuse_wrapped", False):
        return
    original = Worker.load_model

    def load_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if uses_cachefuse(self.vllm_config):
            from vllm.distributed import get_tensor_model_parallel_rank

            _MODELS[engine_key(self.vllm_config, get_tensor_model_parallel_rank())] = self.model_runner.get_model()
        return result

    load_model._cachefuse_wrapped = True  # type: ignore[attr-defined]
    load_model.__wrapped__ = original  # type: ignore[attr-defined]
    Worker.load_model = load_model

"""Connector-enabled vLLM engines for cachefuse's own jobs (precompute, profile, eval), and the request format.

The CLI, `cachefuse.offline` and `cachefuse.eval` drive vLLM through these functions only, so that vllm is
imported under `cachefuse/vllm/` alone. vllm is imported inside the functions that need it: building a
connector config validates it without loading vllm, so bad arguments fail fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cachefuse.chunks import PARAMS_KEY
from cachefuse.config import CacheFuseConfig
from cachefuse.vllm.plugin import CONNECTOR_MODULE, CONNECTOR_NAME


def connector_extra_config(store: Path, config_file: Path | None = None,
                           **overrides: Any) -> tuple[dict[str, Any], CacheFuseConfig]:
    """kv_connector_extra_config for a store directory, a YAML config and field overrides, validated.

    These engines serve no one but the job that built them, so they accept `sync_save` (precompute asks
    for it to learn each chunk's save stored or failed), which a server refuses by default.

    Returns:
        (the dict vLLM passes to the connector, the CacheFuseConfig it yields).

    Raises:
        ConfigError: a field is invalid (the message names it, its value and what is accepted).
    """
    extra: dict[str, Any] = {"store_dir": str(Path(store).expanduser().resolve()),  # the same for every process
                             "allow_sync_save": True}
    if config_file is not None:
        extra = {"config_file": str(config_file), **extra}
    extra.update(overrides)
    return extra, CacheFuseConfig.from_dict(extra)


def connector_llm(model: str | Path, extra: dict[str, Any], *, dtype: str = "auto",
                  max_model_len: int | None = None, kv_cache_memory_bytes: int | None = None,
                  kv_cache_dtype: str = "auto") -> Any:
    """A vllm.LLM with CacheFuseConnector: prefix caching off and recompute on failure, as the connector
    requires; eager mode, since these jobs are prefill-heavy (graphs speed up decode)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    dtype = resolved_dtype(dtype)
    kv_transfer_config = KVTransferConfig(
        kv_connector=CONNECTOR_NAME, kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    kwargs: dict[str, Any] = {}
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    # async scheduling off: vLLM's default on a GPU, refused with the connector (cachefuse.vllm.checks)
    return LLM(model=str(model), dtype=dtype, enforce_eager=True, enable_prefix_caching=False,
               async_scheduling=False, kv_transfer_config=kv_transfer_config, kv_cache_dtype=kv_cache_dtype,
               **kwargs)


def resolved_dtype(dtype: str) -> str:
    """`dtype`, with "auto" made float32 on the CPU. vLLM's CPU platform turns a float32 checkpoint's auto
    into bfloat16, while the servers here run float32 (`examples/serve.sh`); the KV dtype is part of every
    chunk key, so precompute under auto would store chunks no float32 server ever hits."""
    from vllm.platforms import current_platform

    return "float32" if dtype == "auto" and current_platform.is_cpu() else dtype


def sampling_params(*, cachefuse: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """vllm.SamplingParams(**kwargs), carrying `{"kv_transfer_params": {"cachefuse": cachefuse}}` when given
    (a request without it is plain vLLM)."""
    from vllm import SamplingParams

    extra_args = None if cachefuse is None else {"kv_transfer_params": {PARAMS_KEY: cachefuse}}
    return SamplingParams(extra_args=extra_args, **kwargs)

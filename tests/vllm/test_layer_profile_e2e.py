"""A layer profile stored beside the chunks (`cachefuse profile-layers --store`) sets QCFuse's critical
layers in a vLLM engine on that store: the probe then stops after the profiled layer, not after the
default ones (the control: the default's depth on this model is deeper)."""

from __future__ import annotations

from cachefuse.chunks import model_fingerprint
from cachefuse.metadata.layer_profiles import LayerProfile, profile_path, save_profile
from cachefuse.select.qcfuse import default_critical_layers
from tests.helpers.vllm_engines import (
    generate,
    named_prompt,
    precompute,
    random_pieces,
    start_engine,
    stop_engine,
    worker_side,
)


def test_a_stored_profile_sets_the_critical_layers(tiny_model_dir, tmp_path):
    from transformers import AutoConfig

    model = tiny_model_dir("llama")
    num_layers = AutoConfig.from_pretrained(str(model)).num_hidden_layers
    assert max(default_critical_layers(num_layers)) > 0  # else the profile below would change nothing
    recall = tuple(1.0 if layer == 0 else 0.0 for layer in range(num_layers))
    save_profile(LayerProfile(model_fingerprint(model), num_layers, 0.1, "anchors", 0.1, 4, recall, (1.0,), (0,)),
                 profile_path(tmp_path, model_fingerprint(model)))
    pieces = random_pieces(5, {"system": 10, "a": 24, "c": 21, "question": 7})
    llm = start_engine(model, tmp_path, selector="qcfuse")
    try:
        assert worker_side().config.qcfuse_critical_layers == (0,)
        precompute(llm, pieces["system"], [pieces["a"], pieces["c"]])
        ids, params = named_prompt(pieces, ["system", "c", "a", "question"], recompute_ratio=0.3)
        (out,) = generate(llm, [ids], [params])
        stats = out.kv_transfer_params["cachefuse"]
        assert stats["status"] == "fused" and stats["selector"] == "qcfuse" and stats["probe_layers"] == 1, stats
    finally:
        stop_engine(llm)

"""HFAdapter(compile=...): the per-layer elementwise work through torch.compile equals the eager modules.

`aot_eager` traces the same functions through dynamo and AOTAutograd without generating code, so the
test checks what the GPU's inductor build compiles (graph capture, dynamic row counts, one graph for
every layer) in seconds on a CPU; inductor itself runs in `tests/gpu/`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cachefuse.adapters.hf import HFAdapter
from tests.helpers.fusion import make_case, make_engine, precompute_case

pytestmark = pytest.mark.tiny_model("llama", num_layers=3)  # `model_dir`: tests/conftest.py


def _adapter(model_dir, compile):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    return HFAdapter(model, compile=compile)


@pytest.mark.parametrize("selector,ratio", [("full_prefill", 1.0), ("cacheblend", 0.3), ("qcfuse", 0.3)])
def test_compiled_layers_equal_eager(model_dir, selector, ratio):
    torch._dynamo.reset()
    results = []
    for compile in (False, "aot_eager"):
        adapter = _adapter(model_dir, compile)
        engine = make_engine(adapter)
        case = make_case(adapter.shape.vocab_size, seed=2)
        precompute_case(engine, case)
        results.append(engine.prefill(case.token_ids, case.chunks, selector=selector, ratio=ratio,
                                      save_holes=False)[0])
    eager, compiled = results
    torch.testing.assert_close(compiled.logits, eager.logits, atol=1e-5, rtol=1e-5)
    for k_c, k_e in zip(compiled.k, eager.k, strict=True):
        torch.testing.assert_close(k_c, k_e, atol=1e-5, rtol=1e-5)

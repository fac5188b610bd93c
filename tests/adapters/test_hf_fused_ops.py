"""HFAdapter's fused norms and rotation equal the model's own modules, and a layer stays a few calls.

The adapter runs RMSNorm as one `F.rms_norm` call and RoPE as `ops.apply_rope` (one Triton launch per
tensor on CUDA) in place of the transformers modules (eight and ten kernels): a GPU pass over a few
hundred rows is launch-bound. On a CPU in fp32 the results must be the modules' bit for bit, for every
supported family (Llama 3.1's scaled RoPE, Qwen3's q/k norms, Qwen2's biases included), and a whole
prefill through the adapter must equal `model(...)`.

The op budget: each layer's dense work (norms, projections, MLP: everything but the attention and the
rotation, whose CUDA launch count the CPU twin does not show) dispatches at most `DENSE_OPS_PER_LAYER`
non-view aten ops, counted with a TorchDispatchMode. The negative control counts the same layer with
the modules' norms and sees the budget broken, so the counter sees what it claims to.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cachefuse import rope
from cachefuse.adapters import hf

FAMILIES = ["llama", "llama31", "mistral", "qwen2", "qwen3"]
# add, norm, qkv GEMM, (Qwen3: q and k norms), o_proj GEMM, add, norm, gate/up GEMM, silu, mul, down GEMM;
# the modules' norms make it 24 (40 with Qwen3's)
DENSE_OPS_PER_LAYER = 10
VIEW_OPS = {"view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "expand", "slice", "select",
            "split", "split_with_sizes", "chunk", "unbind", "permute", "alias", "detach", "as_strided",
            "reshape", "_reshape_alias", "unflatten", "flatten"}


class OpCounter(TorchDispatchMode):
    """Counts the non-view aten ops dispatched inside it (a CUDA kernel launch each, or more)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEW_OPS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


EVERY_FAMILY = pytest.mark.parametrize("adapter", FAMILIES, indirect=True)
"""The shared module-scoped `adapter` (tests/conftest.py), one per family."""


@EVERY_FAMILY
def test_norms_and_rotation_equal_the_modules_bit_for_bit(adapter):
    g = torch.Generator().manual_seed(0)
    block = adapter.layers[1]
    hidden = torch.randn(37, adapter.shape.hidden_size, generator=g) * 3
    residual = torch.randn(37, adapter.shape.hidden_size, generator=g)
    x, new_residual = adapter.attention_input(1, hidden, residual)
    assert torch.equal(x, block.input_layernorm(hidden + residual)) and torch.equal(new_residual, hidden + residual)
    assert torch.equal(adapter.attention_input(0, hidden, None)[0], adapter.layers[0].input_layernorm(hidden))

    positions = torch.randint(0, 5000, (37,), generator=g).sort().values
    q_nope, k_nope, _ = adapter.project_qkv(1, x)
    q, k = adapter.rotate(1, positions, q_nope, k_nope)
    cos, sin = adapter.decoder.rotary_emb(q_nope, positions[None])
    apply_rotary = sys.modules[type(block.self_attn).__module__].apply_rotary_pos_emb  # the family's own
    q_ref, k_ref = apply_rotary(q_nope.transpose(0, 1)[None], k_nope.transpose(0, 1)[None], cos, sin)
    assert torch.equal(q, q_ref[0].transpose(0, 1)) and torch.equal(k, k_ref[0].transpose(0, 1))
    # the same rotation the loaded chunks' keys get
    assert torch.equal(k, rope.apply_rope(k_nope, positions, adapter.rope_spec))


@EVERY_FAMILY
def test_prefill_through_the_adapter_equals_the_model(adapter):
    ids = torch.randint(3, adapter.shape.vocab_size, (41,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = adapter.model(ids[None]).logits[0, -1].float()
        hidden, residual = adapter.embed(ids), None
        positions = torch.arange(ids.numel())
        for layer in range(adapter.shape.num_layers):
            x, residual = adapter.attention_input(layer, hidden, residual)
            q_nope, k_nope, v = adapter.project_qkv(layer, x)
            q, k = adapter.rotate(layer, positions, q_nope, k_nope)
            attn = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
                scale=adapter.shape.scaling, enable_gqa=True)[0].transpose(0, 1)
            hidden, residual = adapter.attention_output(layer, attn.flatten(1), residual)
        logits = adapter.final_logits(hidden, residual)[-1]
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def _dense_layer_ops(adapter) -> list[str]:
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(19, adapter.shape.hidden_size, generator=g)
    residual = torch.randn(19, adapter.shape.hidden_size, generator=g)
    attn = torch.randn(19, adapter.shape.num_heads * adapter.shape.head_dim, generator=g)
    with torch.inference_mode(), OpCounter() as counter:
        x, residual = adapter.attention_input(1, hidden, residual)
        adapter.project_qkv(1, x)
        adapter.attention_output(1, attn, residual)
    return counter.ops


@EVERY_FAMILY
def test_a_layers_dense_work_stays_within_its_op_budget(adapter):
    ops = _dense_layer_ops(adapter)
    assert len(ops) <= DENSE_OPS_PER_LAYER + (2 if hasattr(adapter.layers[1].self_attn, "q_norm") else 0), ops


@EVERY_FAMILY
def test_negative_control_the_modules_norms_break_the_budget(adapter, monkeypatch):
    monkeypatch.setattr(hf, "rms_norm", lambda norm, x: norm(x))
    assert len(_dense_layer_ops(adapter)) > DENSE_OPS_PER_LAYER + 2


@EVERY_FAMILY
def test_q_and_k_rotate_in_one_launch_when_they_share_the_projection(adapter, monkeypatch):
    """On CUDA each apply_rope is a Triton launch (tens of microseconds of host time per layer): q and k,
    neighbouring slices of the fused qkv projection, rotate as one [T, heads + kv_heads, D] tensor. Qwen3
    norms them into tensors of their own, which rotate apart (the control: the counter sees two calls)."""
    calls = []
    real = hf.ops.apply_rope

    def counting(k_nope, positions, spec):
        calls.append(tuple(k_nope.shape))
        return real(k_nope, positions, spec)

    monkeypatch.setattr(hf.ops, "apply_rope", counting)
    x = torch.randn(23, adapter.shape.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():  # as every pass runs: views made there have no `_base`
        q_nope, k_nope, _ = adapter.project_qkv(1, x)
        q, k = adapter.rotate(1, torch.arange(5, 28), q_nope, k_nope)
    shape = adapter.shape
    if hasattr(adapter.layers[1].self_attn, "q_norm"):
        assert calls == [(23, shape.num_heads, shape.head_dim), (23, shape.num_kv_heads, shape.head_dim)]
    else:
        assert calls == [(23, shape.num_heads + shape.num_kv_heads, shape.head_dim)]
    assert tuple(q.shape) == tuple(q_nope.shape) and tuple(k.shape) == tuple(k_nope.shape)


def test_only_adjacent_views_of_one_tensor_rotate_together():
    qkv = torch.randn(5, 4 * 8 + 2 * 2 * 8)
    q, k, v = (t.view(5, -1, 8) for t in qkv.split([32, 16, 16], dim=-1))
    joint = hf._adjacent_heads(q, k)
    assert joint is not None and torch.equal(joint, qkv[:, :48].view(5, 6, 8))
    assert hf._adjacent_heads(q, v) is None  # v's heads do not follow q's
    assert hf._adjacent_heads(k, q) is None  # order matters: q's heads come first
    assert hf._adjacent_heads(q, k.clone()) is None  # another tensor's memory
    assert hf._adjacent_heads(q[:4], k[1:]) is None  # other rows


@EVERY_FAMILY
def test_a_fused_pass_rotates_q_and_k_in_one_launch_per_layer(adapter, monkeypatch, tiny_model_dir):
    """Through Fusor.fuse (inference mode), every rotation of the adapter's own q and k is one call."""
    from cachefuse.config import CacheFuseConfig
    from cachefuse.fusion.fusor import Fusor
    from cachefuse.fusion.plan import FuseRequest
    from cachefuse.select.registry import make_selector
    from tests.helpers.fusion import hole_request_parts

    if hasattr(adapter.layers[1].self_attn, "q_norm"):
        pytest.skip("Qwen3 rotates its normed q and k apart")
    _, case, segments, loaded = hole_request_parts(adapter, seed=4)
    shapes = []
    real = hf.ops.apply_rope
    monkeypatch.setattr(hf.ops, "apply_rope", lambda k_nope, positions, spec: (
        shapes.append(k_nope.shape[1]), real(k_nope, positions, spec))[1])
    Fusor(adapter).fuse(FuseRequest(torch.tensor(case.token_ids), segments, loaded, 0.3),
                        make_selector("cacheblend", CacheFuseConfig()))
    shape = adapter.shape  # the other calls rotate loaded chunks' keys (kv heads, on the loader's path)
    assert shapes.count(shape.num_heads + shape.num_kv_heads) == shape.num_layers
    assert set(shapes) == {shape.num_heads + shape.num_kv_heads, shape.num_kv_heads}  # q never alone

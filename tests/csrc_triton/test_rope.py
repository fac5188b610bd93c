"""csrc_triton.rope.apply_rope against its torch twin, cachefuse.rope.apply_rope.

Devices: tests/helpers/triton_devices.py (interpreted on the CPU, compiled on a GPU).
"""


import pytest
import torch

from cachefuse import ops, rope
from cachefuse.rope import RopeSpec
from tests.helpers.tolerances import TOL
from tests.helpers.triton_devices import kernel_devices

DEVICES = kernel_devices()
tri_rope = pytest.importorskip("csrc_triton.rope")

DTYPES = [torch.float32, torch.bfloat16]
# (head_dim, rotary_dim): full rotary, and partial with a rotary half (12) the kernel pads to 16.
GEOMETRIES = [(64, 64), (80, 24)]


def make_rope_case(num_tokens, dtype, device, head_dim=64, rotary_dim=64, is_neox_style=True,
                   scaling=1.0, num_heads=2):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    spec = RopeSpec(head_dim, rotary_dim, is_neox_style, inv_freq, scaling).to(device)
    k_nope = torch.randn(num_tokens, num_heads, head_dim).to(device=device, dtype=dtype)
    positions = torch.randint(-64, 8192, (num_tokens,), device=device)
    return k_nope, positions, spec


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens", [1, 17, 300])
@pytest.mark.parametrize("is_neox_style", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"d{g[0]}r{g[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rope_matches_twin(device, num_tokens, is_neox_style, geometry, dtype):
    head_dim, rotary_dim = geometry
    k_nope, positions, spec = make_rope_case(num_tokens, dtype, device, head_dim, rotary_dim, is_neox_style)
    expected = rope.apply_rope(k_nope.clone(), positions, spec)
    before = k_nope.clone()
    actual = tri_rope.apply_rope(k_nope, positions, spec)
    assert actual.dtype == dtype and actual.shape == k_nope.shape
    torch.testing.assert_close(actual, expected, **TOL[dtype])
    assert torch.equal(k_nope, before)  # the input (a stored cache) is never written
    assert torch.equal(actual[..., rotary_dim:], k_nope[..., rotary_dim:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("is_neox_style", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_apply_rope_mscale_and_strided_heads(device, is_neox_style, dtype):
    """YaRN's attention_scaling, and k_nope a head slice of a wider tensor (token/head strides)."""
    wide, positions, spec = make_rope_case(33, dtype, device, 64, 32, is_neox_style,
                                           scaling=1.1386, num_heads=5)
    k_nope = wide[:, 1:4]  # [33, 3, 64], not contiguous
    expected = rope.apply_rope(k_nope.clone(), positions, spec)
    actual = tri_rope.apply_rope(k_nope, positions, spec)
    torch.testing.assert_close(actual, expected, **TOL[dtype])
    wrong = rope.apply_rope(k_nope, positions, RopeSpec(64, 32, not is_neox_style, spec.inv_freq, 1.1386))
    assert (actual.float() - wrong.float()).abs().max() > 0.1  # negative control: the comparison can fail


@pytest.mark.parametrize("device", DEVICES)
def test_apply_rope_rejects_bad_arguments(device):
    k_nope, positions, spec = make_rope_case(4, torch.float32, device)
    with pytest.raises(ValueError, match="int64"):
        tri_rope.apply_rope(k_nope, positions.to(torch.int32), spec)
    with pytest.raises(ValueError, match="contiguous last dim"):
        tri_rope.apply_rope(k_nope.transpose(0, 2).contiguous().transpose(0, 2), positions, spec)
    assert tri_rope.apply_rope(k_nope[:0], positions[:0], spec).shape == (0, 2, 64)


@pytest.mark.parametrize("device", DEVICES)
def test_ops_dispatch(device):
    """ops.apply_rope runs the kernel for CUDA tensors and the twin (bit for bit) elsewhere."""
    k_nope, positions, spec = make_rope_case(9, torch.float32, device)
    expected = rope.apply_rope(k_nope, positions, spec)
    actual = ops.apply_rope(k_nope, positions, spec)
    if k_nope.is_cuda:
        torch.testing.assert_close(actual, expected, **TOL[torch.float32])
    else:
        assert torch.equal(actual, expected)
    k = ops.apply_rope(k_nope, positions, spec)
    torch.testing.assert_close(ops.strip_rope(k, positions, spec), k_nope, **TOL[torch.float32])
    torch.testing.assert_close(ops.shift_rope(ops.shift_rope(k, 5, spec), -5, spec), k, **TOL[torch.float32])

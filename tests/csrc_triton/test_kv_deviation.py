"""csrc_triton.kv_deviation.row_sq_dist against its torch twin, cachefuse.deviation.row_sq_dist.

Devices: tests/helpers/triton_devices.py (interpreted on the CPU, compiled on a GPU).
"""

import pytest
import torch

from cachefuse import deviation, ops
from cachefuse.select.base import CheckLayerKV
from cachefuse.select.cacheblend import kv_deviation
from tests.helpers.triton_devices import kernel_devices

DEVICES = kernel_devices()
tri_kv_deviation = pytest.importorskip("csrc_triton.kv_deviation")

DTYPES = [torch.float32, torch.bfloat16]
# (num_kv_heads, head_dim): a power-of-two head, and an 80-wide head the kernel pads to 128.
GEOMETRIES = [(2, 64), (3, 80)]
# Both sides sum the same fp32 squares (inputs are upcast exactly), in a different order: the
# result differs by fp32 summation rounding only, whatever the input dtype.
TOL = dict(atol=1e-5, rtol=1e-5)


def make_pair(num_rows, num_heads, head_dim, dtype, device):
    """Fresh and loaded K-like tensors whose rows deviate by different amounts."""
    a = torch.randn(num_rows, num_heads, head_dim)
    b = a + torch.randn(num_rows, num_heads, head_dim) * (0.1 + torch.rand(num_rows, 1, 1))
    return a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_rows", [1, 17, 300])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"h{g[0]}d{g[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_sq_dist_matches_twin(device, num_rows, geometry, dtype):
    a, b = make_pair(num_rows, *geometry, dtype, device)
    before = (a.clone(), b.clone())
    expected = deviation.row_sq_dist(a, b)
    actual = tri_kv_deviation.row_sq_dist(a, b)
    assert actual.dtype == torch.float32 and actual.shape == (num_rows,)
    torch.testing.assert_close(actual, expected, **TOL)
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])  # inputs are never written
    # Negative control: one row's worth of squares off (a head left out) is far outside the tolerance.
    assert (actual - deviation.row_sq_dist(a[:, 1:], b[:, 1:])).abs().max() > 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_row_sq_dist_strided_and_mixed_dtypes(device):
    """Head slices of wider tensors (token/head strides), a transposed last dim, bf16 against fp32."""
    wide_a, wide_b = make_pair(33, 5, 64, torch.float32, device)
    a, b = wide_a[:, 1:4], wide_b[:, 1:4]  # [33, 3, 64], not contiguous
    torch.testing.assert_close(tri_kv_deviation.row_sq_dist(a, b), deviation.row_sq_dist(a, b), **TOL)
    b_t = b.transpose(1, 2).contiguous().transpose(1, 2)  # last dim stride 3
    torch.testing.assert_close(tri_kv_deviation.row_sq_dist(a, b_t), deviation.row_sq_dist(a, b), **TOL)
    a16 = a.to(torch.bfloat16)
    torch.testing.assert_close(tri_kv_deviation.row_sq_dist(a16, b), deviation.row_sq_dist(a16, b), **TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_row_sq_dist_rejects_bad_arguments(device):
    a, b = make_pair(4, 2, 64, torch.float32, device)
    with pytest.raises(ValueError, match="expected a and b"):
        tri_kv_deviation.row_sq_dist(a, b[:3])
    with pytest.raises(ValueError, match="fp32/fp16/bf16 b"):
        tri_kv_deviation.row_sq_dist(a, b.to(torch.float64))
    assert tri_kv_deviation.row_sq_dist(a[:0], b[:0]).shape == (0,)
    assert torch.equal(tri_kv_deviation.row_sq_dist(a, a), torch.zeros(4, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_ops_dispatch_and_cacheblend(device):
    """ops.row_sq_dist runs the kernel for CUDA tensors and the twin (bit for bit) elsewhere, and
    cacheblend's kv_deviation is that reduction."""
    a, b = make_pair(9, 2, 64, torch.float32, device)
    expected = deviation.row_sq_dist(a, b)
    actual = ops.row_sq_dist(a, b)
    if a.is_cuda:
        torch.testing.assert_close(actual, expected, **TOL)
    else:
        assert torch.equal(actual, expected)
    v_a, v_b = make_pair(9, 2, 64, torch.float32, device)
    kv = CheckLayerKV(torch.arange(9, device=device), a, v_a, b, v_b)
    torch.testing.assert_close(kv_deviation(kv, "k"), expected, **TOL)
    torch.testing.assert_close(kv_deviation(kv, "v"), deviation.row_sq_dist(v_a, v_b), **TOL)

"""csrc_triton.gather_rotate.gather_rotate against its torch twin, cachefuse.rope.gather_rotate.

Devices: tests/helpers/triton_devices.py (interpreted on the CPU, compiled on a GPU).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cachefuse import ops, rope
from cachefuse.rope import RopeSpec
from tests.helpers.tolerances import TOL
from tests.helpers.triton_devices import kernel_devices

DEVICES = kernel_devices()
tri_gather_rotate = pytest.importorskip("csrc_triton.gather_rotate")

DTYPES = [torch.float32, torch.bfloat16]
# (head_dim, rotary_dim): full rotary, and partial with a rotary half (12) the kernel pads to 16.
GEOMETRIES = [(64, 64), (80, 24)]


def make_spec(device, head_dim=64, rotary_dim=64, is_neox_style=True, scaling=1.0):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    return RopeSpec(head_dim, rotary_dim, is_neox_style, inv_freq, scaling).to(device)


def make_case(num_tokens, num_dst_rows, dtype, device, spec, num_heads=2, stored_rotated=False):
    """src rows, a dst of NaN sentinels, distinct random dst_rows and positions; src rotated when asked."""
    k_nope = torch.randn(num_tokens, num_heads, spec.head_dim).to(device=device, dtype=dtype)
    dst = torch.full((num_dst_rows, num_heads, spec.head_dim), float("nan"), dtype=dtype, device=device)
    dst_rows = torch.randperm(num_dst_rows)[:num_tokens].to(device)
    dst_positions = torch.randint(-64, 8192, (num_tokens,), device=device)
    src_positions = torch.randint(1, 8192, (num_tokens,), device=device) if stored_rotated else None
    src = rope.apply_rope(k_nope, src_positions, spec) if stored_rotated else k_nope
    return src, dst, dst_rows, dst_positions, src_positions


def untouched(dst: torch.Tensor, dst_rows: torch.Tensor) -> torch.Tensor:
    """The rows of dst outside dst_rows."""
    keep = torch.ones(dst.shape[0], dtype=torch.bool, device=dst.device)
    keep[dst_rows] = False
    return dst[keep]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens,num_dst_rows", [(1, 1), (17, 40), (300, 301)])
@pytest.mark.parametrize("is_neox_style", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"d{g[0]}r{g[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stored_rotated", [False, True], ids=["nope", "rotated"])
def test_gather_rotate_matches_twin(device, num_tokens, num_dst_rows, is_neox_style, geometry, dtype,
                                    stored_rotated):
    head_dim, rotary_dim = geometry
    spec = make_spec(device, head_dim, rotary_dim, is_neox_style)
    src, dst, dst_rows, dst_positions, src_positions = make_case(num_tokens, num_dst_rows, dtype, device, spec,
                                                                 stored_rotated=stored_rotated)
    before = src.clone()
    expected = rope.gather_rotate(src, dst.clone(), dst_rows, dst_positions, spec, src_positions)
    actual = tri_gather_rotate.gather_rotate(src, dst, dst_rows, dst_positions, spec, src_positions)
    assert actual is dst and actual.dtype == dtype
    torch.testing.assert_close(actual[dst_rows], expected[dst_rows], **TOL[dtype])
    assert untouched(actual, dst_rows).isnan().all()  # rows outside dst_rows are never written
    assert torch.equal(src, before)  # the input (a stored cache) is never written
    assert torch.equal(actual[dst_rows][..., rotary_dim:], src[..., rotary_dim:])
    if stored_rotated:  # negative control: ignoring src_positions is far off, so the comparison can fail
        wrong = rope.gather_rotate(src, dst.clone(), dst_rows, dst_positions, spec)
        assert (actual[dst_rows].float() - wrong[dst_rows].float()).abs().max() > 0.1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_twin_is_apply_rope_then_index_copy(device, dtype):
    """Without src_positions the twin is apply_rope's bits; with them, strip + apply to rounding."""
    spec = make_spec(device, 80, 24, False)
    src, dst, dst_rows, dst_positions, _ = make_case(17, 20, dtype, device, spec)
    out = rope.gather_rotate(src, dst, dst_rows, dst_positions, spec)
    assert torch.equal(out[dst_rows], rope.apply_rope(src, dst_positions, spec))
    src_positions = torch.randint(0, 4096, (17,), device=device)
    k = rope.apply_rope(src, src_positions, spec)
    out = rope.gather_rotate(k, dst, dst_rows, dst_positions, spec, src_positions)
    torch.testing.assert_close(out[dst_rows], rope.apply_rope(src, dst_positions, spec), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("is_neox_style", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gather_rotate_mscale_and_strided(device, is_neox_style, dtype):
    """YaRN's attention_scaling; src a head slice, dst rows of a wider token stride (a paged view)."""
    spec = make_spec(device, 64, 32, is_neox_style, scaling=1.1386)
    wide, _, dst_rows, dst_positions, _ = make_case(33, 50, dtype, device, spec, num_heads=5)
    src_positions = torch.randint(0, 8192, (33,), device=device)
    src = rope.apply_rope(wide, src_positions, spec)[:, 1:4]  # rotated, [33, 3, 64], token stride 5 heads
    pages = torch.full((50, 2, 3, 64), float("nan"), dtype=dtype, device=device)
    dst = pages[:, 1]  # [50, 3, 64], token stride 2 * 3 * 64
    for positions in (None, src_positions):
        expected = rope.gather_rotate(src, dst.clone(), dst_rows, dst_positions, spec, positions)
        actual = tri_gather_rotate.gather_rotate(src, dst, dst_rows, dst_positions, spec, positions)
        torch.testing.assert_close(actual[dst_rows], expected[dst_rows], **TOL[dtype])
    assert pages[:, 0].isnan().all() and untouched(dst, dst_rows).isnan().all()
    # Negative control: the other layout is far off, so the comparison above can fail.
    wrong = rope.gather_rotate(src, dst.clone(), dst_rows, dst_positions,
                               RopeSpec(64, 32, not is_neox_style, spec.inv_freq, 1.1386), src_positions)
    assert (actual[dst_rows].float() - wrong[dst_rows].float()).abs().max() > 0.1


@pytest.mark.parametrize("device", DEVICES)
def test_gather_rotate_rejects_bad_arguments(device):
    spec = make_spec(device)
    src, dst, dst_rows, dst_positions, _ = make_case(4, 8, torch.float32, device, spec)
    with pytest.raises(ValueError, match="int64 dst_rows"):
        tri_gather_rotate.gather_rotate(src, dst, dst_rows.to(torch.int32), dst_positions, spec)
    with pytest.raises(ValueError, match="int64 src_positions"):
        tri_gather_rotate.gather_rotate(src, dst, dst_rows, dst_positions, spec, dst_positions[:3])
    with pytest.raises(ValueError, match="heads"):
        tri_gather_rotate.gather_rotate(src, dst[:, :1], dst_rows, dst_positions, spec)
    with pytest.raises(ValueError, match="contiguous last dim"):
        tri_gather_rotate.gather_rotate(src.transpose(0, 2).contiguous().transpose(0, 2), dst, dst_rows,
                                        dst_positions, spec)
    empty = tri_gather_rotate.gather_rotate(src[:0], dst, dst_rows[:0], dst_positions[:0], spec)
    assert empty is dst and dst.isnan().all()


@pytest.mark.parametrize("device", DEVICES)
def test_ops_dispatch(device):
    """ops.gather_rotate runs the kernel for CUDA tensors and the twin (bit for bit) elsewhere."""
    spec = make_spec(device)
    src, dst, dst_rows, dst_positions, _ = make_case(9, 12, torch.float32, device, spec)
    expected = rope.gather_rotate(src, dst.clone(), dst_rows, dst_positions, spec)
    actual = ops.gather_rotate(src, dst, dst_rows, dst_positions, spec)
    assert actual is dst
    if dst.is_cuda:
        torch.testing.assert_close(actual, expected, **TOL[torch.float32], equal_nan=True)
    else:
        assert torch.equal(actual[dst_rows], expected[dst_rows])


_PAST_INT32_SCRIPT = """
import sys, torch
from cachefuse import rope
from tests.csrc_triton.test_gather_rotate import make_spec
import csrc_triton.gather_rotate as tri

path, stride = sys.argv[1], 1 << 30  # elements: token 2 of src starts at element 2**31
nbytes = (2 * stride + 64) * 4
with open(path, "wb") as f:
    f.truncate(nbytes)  # sparse: only the three rows written below take pages
flat = torch.tensor([], dtype=torch.float32).set_(torch.UntypedStorage.from_file(path, True, nbytes))
src = flat.as_strided((3, 1, 64), (stride, 64, 1))
values = torch.randn(3, 1, 64)
src.copy_(values)
spec = make_spec("cpu")
rows, positions = torch.tensor([2, 0, 1]), torch.tensor([5, 900, 70000])
expected = rope.gather_rotate(values, torch.zeros(3, 1, 64), rows, positions, spec)
actual = tri.gather_rotate(src, torch.zeros(3, 1, 64), rows, positions, spec)
print(float((actual - expected).abs().max()))
"""


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter reads CPU memory")
def test_source_offsets_past_int32_do_not_wrap(tmp_path):
    """Token x token-stride passed 2**31 elements on long prompts (a q view of Llama-3-8B from 349,526
    tokens) and wrapped in int32 to an address before the tensor. src here is a view of a sparse 8 GiB
    file whose third token starts at element 2**31. In a child process: the int32 kernel reads out of
    bounds and dies with SIGSEGV (checked by hand), which must not take the suite with it."""
    result = subprocess.run([sys.executable, "-c", _PAST_INT32_SCRIPT, str(tmp_path / "sparse")],
                            capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[2], env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, f"rc {result.returncode}: {result.stderr[-2000:]}"
    assert float(result.stdout.strip().splitlines()[-1]) < 1e-5

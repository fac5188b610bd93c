"""csrc_triton.sparse_attention against its torch twins, cachefuse.attention.rows_attention and
cachefuse.attention.varlen_rows_attention.

"cpu" runs under TRITON_INTERPRET=1 (set by `make test` before triton is imported) on small odd sizes;
"cuda" runs when a GPU is present (marker gpu, `make test-gpu`) and adds long contexts and head_dim 128.
Without either, the module skips. Tolerances are tests/helpers/tolerances.py's TOL: the kernel rounds
the softmax weights to the input dtype before the P@V product (as flash attention does), measured at
most one output ulp from the twin (bf16 <= 1.6e-2 on outputs of magnitude <= 4, fp16 <= 1e-3).
"""


import pytest
import torch

from cachefuse import attention, ops
from tests.helpers.tolerances import TOL
from tests.helpers.triton_devices import kernel_devices

DEVICES = kernel_devices()
tri_attn = pytest.importorskip("csrc_triton.sparse_attention")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (num_rows, num_tokens): odd sizes, one row, rows filling most of the keys, several row blocks.
SIZES = [(1, 1), (1, 9), (1, 299), (7, 9), (7, 67), (7, 299), (65, 67), (65, 299)]
NUM_KV_HEADS = 2


def make_rows_case(num_rows, num_tokens, group, dtype, device, head_dim=64, seed=0):
    """q [R, Hkv*group, D] at R random sorted distinct positions (0 and N-1 among them), k, v [N, Hkv, D]."""
    g = torch.Generator().manual_seed(seed)
    num_heads = NUM_KV_HEADS * group
    q = torch.randn(num_rows, num_heads, head_dim, generator=g)
    k = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=g)
    v = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=g)
    inner = torch.randperm(max(num_tokens - 2, 0), generator=g)[: max(num_rows - 2, 0)] + 1
    ends = [num_tokens - 1] if num_rows == 1 else [0, num_tokens - 1]
    positions = torch.cat([inner, torch.tensor(ends)]).sort().values  # int64 [R], distinct
    assert positions.unique().numel() == num_rows
    to = dict(device=device, dtype=dtype)
    return q.to(**to), positions.to(device), k.to(**to), v.to(**to), head_dim**-0.5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"r{s[0]}n{s[1]}")
@pytest.mark.parametrize("group", [1, 3], ids=["mha", "gqa3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_attention_matches_twin(device, size, group, dtype):
    q, positions, k, v, scale = make_rows_case(*size, group, dtype, device)
    expected = attention.rows_attention(q, positions, k, v, scale)
    actual = tri_attn.rows_attention(q, positions, k, v, scale)
    assert actual.dtype == dtype and actual.shape == q.shape
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
@pytest.mark.parametrize("size", [(300, 4097), (1000, 8191)], ids=lambda s: f"r{s[0]}n{s[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_attention_long_context(device, size, head_dim, dtype):
    q, positions, k, v, scale = make_rows_case(*size, 4, dtype, device, head_dim)
    expected = attention.rows_attention(q, positions, k, v, scale)
    torch.testing.assert_close(tri_attn.rows_attention(q, positions, k, v, scale), expected, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [16, 80, 128, 256])
def test_rows_attention_head_dims(device, head_dim):
    """Powers of two, and a non-power (80) the kernel pads to 128 with masks."""
    q, positions, k, v, scale = make_rows_case(7, 41, 2, torch.float32, device, head_dim)
    expected = attention.rows_attention(q, positions, k, v, scale)
    torch.testing.assert_close(tri_attn.rows_attention(q, positions, k, v, scale), expected, **TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_attention_strided_views(device, dtype):
    """q, k, v as head slices of packed qkv tensors (token and head strides differ from contiguous)."""
    q_wide, positions, k_wide, v_wide, scale = make_rows_case(19, 77, 2, dtype, device)
    q, k, v = q_wide[:, 1:3], k_wide[:, 1:], v_wide[:, 1:]  # [19, 2, 64], [77, 1, 64]: views
    expected = attention.rows_attention(q.contiguous(), positions, k.contiguous(), v.contiguous(), scale)
    torch.testing.assert_close(tri_attn.rows_attention(q, positions, k, v, scale), expected, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_matches_twin_and_single_launches(device, dtype):
    """Three requests of different lengths, and one with keys but no rows, packed into one launch.

    ```
    rows | req 0: 5 | req 1: 20 | req 3: 1 |
    keys | req 0: 37 | req 1: 131 | req 2: 7 (no rows) | req 3: 3 |
    ```
    """
    cases = [make_rows_case(r, n, 3, dtype, device, seed=i) for i, (r, n) in enumerate([(5, 37), (20, 131), (1, 3)])]
    _, _, filler, _, scale = make_rows_case(1, 7, 3, dtype, device, seed=9)
    q = torch.cat([c[0] for c in cases])  # [26, 6, 64]
    positions = torch.cat([c[1] for c in cases])  # relative to each request's first key
    k = torch.cat([cases[0][2], cases[1][2], filler, cases[2][2]])  # [178, 2, 64]
    v = torch.cat([cases[0][3], cases[1][3], filler, cases[2][3]])
    cu_rows = torch.tensor([0, 5, 25, 25, 26], dtype=torch.int32, device=device)
    cu_keys = torch.tensor([0, 37, 168, 175, 178], dtype=torch.int32, device=device)
    expected = attention.varlen_rows_attention(q, positions, cu_rows, k, v, cu_keys, scale)
    actual = tri_attn.varlen_rows_attention(q, positions, cu_rows, k, v, cu_keys, scale)
    torch.testing.assert_close(actual, expected, **TOL[dtype])
    for begin, end, case in zip([0, 5, 25], [5, 25, 26], cases, strict=True):
        torch.testing.assert_close(actual[begin:end], tri_attn.rows_attention(*case), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_negative_controls(device):
    """The comparison can fail: a twin with the causal mask off, or shifted by one key, differs."""
    q, positions, k, v, scale = make_rows_case(7, 67, 3, torch.float32, device)
    actual = tri_attn.rows_attention(q, positions, k, v, scale)
    torch.testing.assert_close(actual, attention.rows_attention(q, positions, k, v, scale), **TOL[torch.float32])
    no_mask = attention.rows_attention(q, torch.full_like(positions, k.shape[0] - 1), k, v, scale)
    off_by_one = attention.rows_attention(q[:-1], positions[:-1] + 1, k, v, scale)  # j <= p + 1
    assert (actual - no_mask).abs().max() > 0.1
    assert (actual[:-1] - off_by_one).abs().amax(dim=(1, 2)).min() > 1e-3  # every row differs


@pytest.mark.parametrize("device", DEVICES)
def test_rows_attention_unsorted_rows_are_exact(device):
    """The kernel truncates at each block's max position, not its last row's: row order does not matter."""
    q, positions, k, v, scale = make_rows_case(40, 211, 1, torch.float32, device)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(1)).to(device)
    sorted_out = tri_attn.rows_attention(q, positions, k, v, scale)
    torch.testing.assert_close(tri_attn.rows_attention(q[perm], positions[perm], k, v, scale), sorted_out[perm],
                               **TOL[torch.float32])
    # the twin (ops on a CPU) takes them in any order too: it once cut each block at its last row's keys
    twin = attention.rows_attention(q[perm].cpu(), positions[perm].cpu(), k.cpu(), v.cpu(), scale, block_rows=8)
    torch.testing.assert_close(twin, sorted_out[perm].cpu(), **TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_refuses_offsets_past_its_tensors(device):
    """The kernel would read keys (and read and write rows) past the tensors' ends; the twin slices."""
    q, positions, k, v, scale = make_rows_case(4, 9, 1, torch.float32, device)
    rows = torch.tensor([0, 4], device=device)
    tri_attn.varlen_rows_attention(q, positions, rows, k, v, torch.tensor([0, 9], device=device), scale)  # fits
    with pytest.raises(ValueError, match="cu_keys"):
        tri_attn.varlen_rows_attention(q, positions, rows, k, v, torch.tensor([0, 12], device=device), scale)
    with pytest.raises(ValueError, match="cu_rows"):
        tri_attn.varlen_rows_attention(q, positions, torch.tensor([0, 6], device=device), k, v,
                                       torch.tensor([0, 9], device=device), scale)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_attention_rejects_bad_arguments(device):
    q, positions, k, v, scale = make_rows_case(4, 9, 1, torch.float32, device)
    with pytest.raises(ValueError, match="int64"):
        tri_attn.rows_attention(q, positions.to(torch.int32), k, v, scale)
    with pytest.raises(ValueError, match="one dtype"):
        tri_attn.rows_attention(q, positions, k.half(), v.half(), scale)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tri_attn.rows_attention(q[:, :1], positions, k, v, scale)
    with pytest.raises(ValueError, match="contiguous last dim"):
        tri_attn.rows_attention(q.transpose(0, 2).contiguous().transpose(0, 2), positions, k, v, scale)
    with pytest.raises(ValueError, match="cu_rows"):
        tri_attn.varlen_rows_attention(q, positions, torch.tensor([0.0, 4.0], device=device), k, v,
                                       torch.tensor([0, 9], device=device), scale)
    assert tri_attn.rows_attention(q[:0], positions[:0], k, v, scale).shape == (0, 2, 64)


@pytest.mark.parametrize("device", DEVICES)
def test_ops_dispatch(device):
    """ops runs the kernel for CUDA tensors and the twin (bit for bit) elsewhere."""
    q, positions, k, v, scale = make_rows_case(7, 67, 3, torch.float32, device)
    cu_rows = torch.tensor([0, 3, 7], device=device)
    cu_keys = torch.tensor([0, 30, 97], device=device)
    k2, v2 = torch.cat([k[:30], k]), torch.cat([v[:30], v])
    q_positions = torch.cat([torch.tensor([0, 11, 29], device=device), positions[3:]])
    expected = attention.rows_attention(q, positions, k, v, scale)
    expected_varlen = attention.varlen_rows_attention(q, q_positions, cu_rows, k2, v2, cu_keys, scale)
    actual = ops.rows_attention(q, positions, k, v, scale)
    actual_varlen = ops.varlen_rows_attention(q, q_positions, cu_rows, k2, v2, cu_keys, scale)
    if q.is_cuda:
        torch.testing.assert_close(actual, expected, **TOL[torch.float32])
        torch.testing.assert_close(actual_varlen, expected_varlen, **TOL[torch.float32])
    else:
        assert torch.equal(actual, expected) and torch.equal(actual_varlen, expected_varlen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [(1, 9), (7, 67), (65, 299)], ids=lambda s: f"r{s[0]}n{s[1]}")
@pytest.mark.parametrize("window", [1, 5, 33, 400])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_attention_with_window_matches_twin(device, size, window, dtype):
    """A sliding window (key j visible iff p - window < j <= p): windows shorter than a tile, longer than
    a tile, and longer than the prompt; a window of 1 (each row sees itself only)."""
    q, positions, k, v, scale = make_rows_case(*size, 3, dtype, device)
    expected = attention.rows_attention(q, positions, k, v, scale, window=window)
    actual = tri_attn.rows_attention(q, positions, k, v, scale, window)
    torch.testing.assert_close(actual, expected, **TOL[dtype])
    if window < size[1] - 1:  # negative control: the unwindowed kernel differs from the windowed twin
        plain = tri_attn.rows_attention(q, positions, k, v, scale)
        assert (plain - expected).float().abs().max() > 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_and_slot_rows_attention_with_window_match_twins(device):
    from tests.csrc_triton.test_slot_attention import flash_layout_cache

    window = 11
    cases = [make_rows_case(r, n, 2, torch.float32, device, seed=i) for i, (r, n) in enumerate([(5, 37), (20, 131)])]
    q = torch.cat([c[0] for c in cases])
    positions = torch.cat([c[1] for c in cases])
    k, v = torch.cat([c[2] for c in cases]), torch.cat([c[3] for c in cases])
    cu_rows = torch.tensor([0, 5, 25], dtype=torch.int32, device=device)
    cu_keys = torch.tensor([0, 37, 168], dtype=torch.int32, device=device)
    scale = cases[0][4]
    expected = attention.varlen_rows_attention(q, positions, cu_rows, k, v, cu_keys, scale, window=window)
    actual = tri_attn.varlen_rows_attention(q, positions, cu_rows, k, v, cu_keys, scale, window)
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])
    q1, pos1, k1, v1, _ = cases[1]
    k_cache, v_cache, key_slots = flash_layout_cache(k1, v1, page_size=16, num_pages=20)
    expected = attention.slot_rows_attention(q1, pos1, k_cache, v_cache, key_slots, scale, window=window)
    actual = tri_attn.slot_rows_attention(q1, pos1, k_cache, v_cache, key_slots, scale, window)
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])
    with pytest.raises(ValueError, match="sliding window"):
        tri_attn.rows_attention(q1, pos1, k1, v1, scale, 0)

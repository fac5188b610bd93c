"""The gate's model geometry, torch-free: a dtype table in place of a tensor's element size."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cachefuse.errors import ConfigError
from cachefuse.vllm.scheduler_side.gate import DTYPE_BYTES, dtype_bytes, kv_geometry


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_dtype_bytes_matches_torch(dtype):
    assert dtype_bytes(dtype) == torch.empty(0, dtype=dtype).element_size()
    assert dtype_bytes(str(dtype).removeprefix("torch.")) == dtype_bytes(dtype)  # a name works too


def test_an_unknown_dtype_is_named_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"'complex64'.*float32"):
        dtype_bytes(torch.complex64)
    assert "complex64" not in DTYPE_BYTES


def test_kv_geometry_counts_this_ranks_heads_over_all_layers():
    hf = SimpleNamespace(num_hidden_layers=4, hidden_size=64, num_attention_heads=8, num_key_value_heads=2)
    assert kv_geometry(hf, torch.bfloat16, tp_size=1) == (4, 2 * 2 * 8 * 2 * 4)  # K and V, 2 heads of 8, 2 bytes
    assert kv_geometry(hf, "float32", tp_size=4) == (4, 2 * 1 * 8 * 4 * 4)  # at least one head per rank
    hf.head_dim = 16  # an explicit head_dim wins over hidden_size / heads
    assert kv_geometry(hf, "float32", tp_size=2) == (4, 2 * 1 * 16 * 4 * 4)

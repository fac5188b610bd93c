"""The devices a Triton kernel test runs on, one rule for every file in tests/csrc_triton.

"cpu" under TRITON_INTERPRET=1 (set by `make test` before triton is imported); "cuda" when a GPU is
present (marker gpu, `make test-gpu`). With neither, the calling test module is skipped.
"""

import os

import pytest
import torch


def kernel_devices() -> list:
    """Call at module level: the `device` parameters, or a module-level skip."""
    devices = []
    if os.environ.get("TRITON_INTERPRET") == "1":
        devices.append("cpu")
    if torch.cuda.is_available():
        devices.append(pytest.param("cuda", marks=pytest.mark.gpu))
    if not devices:
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)
    return devices

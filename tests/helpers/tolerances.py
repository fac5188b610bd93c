"""Per-dtype comparison tolerances, one table for every kernel-vs-twin and twin-vs-engine test.

bf16 and fp16: a result that sits on a rounding boundary may land one ulp apart when the two sides
compute in different precisions (vLLM and transformers rotate in the model dtype, the twin in
fp32); one bf16 ulp is 2**-7 relative, one fp16 ulp 2**-10.
"""

import torch

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}

LOGPROB_TOL = 5e-5
"""Largest |logprob difference| between a fused request and vLLM's own prefill, fp32 end to end
(measured differences are ~1e-6: GEMM and SDPA summation order)."""

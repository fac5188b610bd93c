"""Runs one fused workload on an engine of a given tensor-parallel size; prints JSON results.

A script (not a test module) because TP > 1 spawns worker processes, which re-import __main__.
    python tests/vllm/tp_probe.py MODEL_DIR STORE_DIR TP_SIZE
"""

import json
import os
import sys


def main() -> None:
    model_dir, store_dir, tp_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    import torch
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(kv_connector="CacheFuseConnector", kv_connector_module_path="cachefuse.vllm.connector",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"store_dir": store_dir})
    llm = LLM(model=model_dir, dtype="float32", max_model_len=2048, enforce_eager=True,
              enable_prefix_caching=False, kv_transfer_config=kv, tensor_parallel_size=tp_size,
              distributed_executor_backend="mp" if tp_size > 1 else None, kv_cache_memory_bytes=64 << 20,
              max_logprobs=20, seed=0)
    g = torch.Generator().manual_seed(0)
    system, a, c, question = (torch.randint(3, 1000, (n,), generator=g).tolist() for n in (12, 40, 30, 9))
    results = {}
    runs = [("precompute_a", system + a + [5], [[0, 12], [12, 52]], 1.0),
            ("precompute_c", system + c + [5], [[0, 12], [12, 42]], 1.0),
            ("ratio_1", system + c + a + question, [[0, 12], [12, 42], [42, 82]], 1.0),
            ("ratio_15", system + c + a + question, [[0, 12], [12, 42], [42, 82]], 0.15)]
    for name, ids, chunks, ratio in runs:
        params = {"cachefuse": {"chunks": chunks, "recompute_ratio": ratio}}
        sampling = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20,
                                  extra_args={"kv_transfer_params": params})
        (out,) = llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False)
        results[name] = {"logprobs": {str(t): lp.logprob for t, lp in out.outputs[0].logprobs[0].items()},
                         "stats": out.kv_transfer_params["cachefuse"]}
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main()

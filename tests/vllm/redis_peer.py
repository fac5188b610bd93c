"""A second vLLM instance for tests/vllm/test_redis_e2e.py: saves chunks into a shared Redis store.

A script (not a test module): a second in-process engine would share the first one's global KV
connector, so the peer runs in its own process, as another machine would.
    python tests/vllm/redis_peer.py MODEL_DIR REDIS_URL REQUESTS_JSON
REQUESTS_JSON: [{"ids": [...], "chunks": [[s, e], ...]}, ...]; prints "RESULT <json>" of each response's stats.
"""

import json
import os
import sys


def main() -> None:
    model_dir, redis_url, requests = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra = {"redis_url": redis_url, "memory_capacity_bytes": 0, "disk_capacity_bytes": 0,
             "collect_attention_stats": True}
    kv = KVTransferConfig(kv_connector="CacheFuseConnector", kv_connector_module_path="cachefuse.vllm.connector",
                          kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    llm = LLM(model=model_dir, dtype="float32", max_model_len=2048, enforce_eager=True, enable_prefix_caching=False,
              kv_transfer_config=kv, kv_cache_memory_bytes=64 << 20, seed=0)
    results = []
    for request in requests:
        params = {"cachefuse": {"chunks": request["chunks"], "selector": "full_prefill"}}
        sampling = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": params})
        (out,) = llm.generate([{"prompt_token_ids": request["ids"]}], sampling, use_tqdm=False)
        results.append(out.kv_transfer_params["cachefuse"])
    print("RESULT " + json.dumps(results), flush=True)
    llm.llm_engine.engine_core.shutdown()
    os._exit(0)  # skip interpreter teardown of vLLM's threads


if __name__ == "__main__":
    main()

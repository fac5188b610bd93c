"""First-token KL of cachefuse on vLLM (CPU) over an fp8 paged KV cache (docs/deploy.md, Supported configurations).

For each `--kv-cache-dtype` (auto, fp8_e4m3, fp8_e5m2): plain vLLM answers the real-text QA set's
prompts (cachefuse.eval.qa_set, validation split), then vLLM with CacheFuseConnector over a fresh store
precomputes their chunks (`cachefuse precompute`'s path) and answers them at ratio 1.0 and with CacheBlend
at 15%. Reported per cache dtype: the first token's KL over the whole vocabulary, in nats, of each
cachefuse setting against plain vLLM over the same cache, and of plain vLLM over that cache against plain
vLLM over an unquantized one (what fp8 costs by itself). K/V scales are the checkpoint's (1.0: SmolLM2
ships none). Engines run in this process one after another, float32, enforce_eager, same threads.

    python benchmarks/fp8_kv_cache.py [--model .cache/models/smollm2-135m-instruct] [--items 8] \
        [--out docs/benchmarks/fp8_kv_cache.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
SETTINGS = {"ratio_1.0": {"selector": "cacheblend", "recompute_ratio": 1.0},
            "cacheblend_0.15": {"selector": "cacheblend", "recompute_ratio": 0.15}}


def start(model: str, cache_dtype: str, store_dir: str | None):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None if store_dir is None else KVTransferConfig(
        kv_connector="CacheFuseConnector", kv_connector_module_path="cachefuse.vllm.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"store_dir": store_dir, "allow_sync_save": True, "force_fuse": True})
    return LLM(model=model, kv_transfer_config=kv, dtype="float32", max_model_len=4096, enforce_eager=True,
               enable_prefix_caching=False, async_scheduling=False, seed=0, kv_cache_memory_bytes=256 << 20,
               kv_cache_dtype=cache_dtype, max_logprobs=-1)


def stop(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def first_token_logprobs(llm, prompts, params) -> list[dict[int, float]]:
    """The first token's logprob of every vocabulary entry, per prompt."""
    from vllm import SamplingParams

    sampling = [SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1,
                               extra_args={"kv_transfer_params": p} if p is not None else None) for p in params]
    outputs = llm.generate([{"prompt_token_ids": p.token_ids} for p in prompts], sampling, use_tqdm=False)
    for output, p in zip(outputs, params, strict=True):
        if p is not None:
            status = output.kv_transfer_params["cachefuse"]
            assert status["status"] == "fused", status
    return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outputs]


def kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p || q) in nats over the vocabulary."""
    return sum(math.exp(lp) * (lp - q[t]) for t, lp in p.items())


def summary(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.environ.get("CACHEFUSE_SMOLLM2_DIR", ".cache/models/smollm2-135m-instruct"))
    parser.add_argument("--items", type=int, default=8)
    parser.add_argument("--out", default="docs/benchmarks/fp8_kv_cache.json")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from cachefuse.eval.qa_set import eval_items, make_items
    from cachefuse.offline.precompute import precompute_chunks
    from cachefuse.rag_prompt import build_rag_prompt

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    items = eval_items(make_items("validation", args.items), tokenizer)
    prompts = [build_rag_prompt(tokenizer, i.system, i.chunks, i.question) for i in items]
    plain: dict[str, list[dict[int, float]]] = {}
    results: dict[str, dict] = {}
    for cache_dtype in CACHE_DTYPES:
        llm = start(args.model, cache_dtype, None)
        plain[cache_dtype] = first_token_logprobs(llm, prompts, [None] * len(prompts))
        stop(llm)
        with tempfile.TemporaryDirectory() as store_dir:
            llm = start(args.model, cache_dtype, store_dir)
            for system in dict.fromkeys(i.system for i in items):
                report = precompute_chunks(llm, tokenizer, system,
                                           dict.fromkeys(c for i in items if i.system == system for c in i.chunks),
                                           store_dir=store_dir, progress=False)
                assert not report.num_failed, report.failures[:3]
            row = {"plain_vs_plain_auto": summary([kl(a, b) for a, b in zip(plain["auto"], plain[cache_dtype],
                                                                           strict=True)])}
            for name, overrides in SETTINGS.items():
                params = [{"cachefuse": {**p.kv_transfer_params()["cachefuse"], **overrides}} for p in prompts]
                fused = first_token_logprobs(llm, prompts, params)
                row[name] = summary([kl(a, b) for a, b in zip(plain[cache_dtype], fused, strict=True)])
                row[name]["top1_agree"] = sum(max(a, key=a.get) == max(b, key=b.get)
                                              for a, b in zip(plain[cache_dtype], fused, strict=True)) / len(prompts)
            stop(llm)
        results[cache_dtype] = row
        print(cache_dtype, json.dumps(row))
    out = {"model": Path(args.model).name, "dtype": "float32", "items": args.items,
           "mean_prompt_tokens": statistics.fmean(p.num_tokens for p in prompts), "kl_nats": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""What the tensor-parallel ranks' failure agreement costs a blend (TP=2 on CPU, a tiny Llama).

    python benchmarks/tp_agreement_cost.py --out /tmp/tp_agreement.json      # ~2 min on 2 CPU cores

Under tensor parallelism the worker's PassBatch agrees, with one all-reduce of a flag per pass, before
every op group that reaches a collective and at the end of each advance; a check layer's score sum is
preceded by one more (cachefuse.fusion.batch, cachefuse.vllm.worker_side). This measures, in the
workers of a real TP=2 engine:

- the latency of one agreement (flags of 1 and of 8 passes) against one all-reduce of the model's own,
  the row-parallel o_proj's of 1 and 64 rows of the hidden size (what a blend layer does twice per layer);
- how many agreements one fused request makes, per layer;
- the request's blend time with the agreement on and off (the same prompt, alternating, median of
  `--repeats` each): the end-to-end figure, noisy on a shared machine.

SmolLM2 cannot run at TP=2 (9 attention heads), so the model is the tests' tiny Llama (4 layers,
hidden 64): the agreement's cost is fixed per call, the model's all-reduce grows with the hidden size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="all-reduces timed per figure")
    parser.add_argument("--repeats", type=int, default=7, help="blends per setting (on / off)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from cachefuse.testing.tiny_models import cached_tiny_model

    model_dir = cached_tiny_model("llama", Path(os.environ.get("CACHEFUSE_TEST_MODEL_CACHE", ".cache/test-models")))
    store_dir = tempfile.mkdtemp(prefix="tp-agreement-")
    kv = KVTransferConfig(kv_connector="CacheFuseConnector", kv_connector_module_path="cachefuse.vllm.connector",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"store_dir": store_dir, "allow_sync_save": True})
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=2048, enforce_eager=True,
              enable_prefix_caching=False, kv_transfer_config=kv, tensor_parallel_size=2,
              distributed_executor_backend="mp", kv_cache_memory_bytes=64 << 20, seed=0)
    g = torch.Generator().manual_seed(0)
    system, a, c, question = (torch.randint(3, 1000, (n,), generator=g).tolist() for n in (12, 40, 30, 9))

    def generate(ids, chunks, ratio, sync_save=False):
        params = {"cachefuse": {"chunks": chunks, "recompute_ratio": ratio, "sync_save": sync_save}}
        sampling = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": params})
        (out,) = llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False)
        return out.kv_transfer_params["cachefuse"]

    generate(system + a + [5], [[0, 12], [12, 52]], 1.0, sync_save=True)
    generate(system + c + [5], [[0, 12], [12, 42]], 1.0, sync_save=True)
    prompt, chunks = system + c + a + question, [[0, 12], [12, 42], [42, 82]]
    latency = llm.collective_rpc(time_all_reduces, args=(args.calls,))[0]
    llm.collective_rpc(count_agreements, args=(True,))
    stats = generate(prompt, chunks, 0.15)
    counts = llm.collective_rpc(count_agreements, args=(False,))
    blend = {"on": [], "off": []}
    for _ in range(args.repeats):
        for setting in ("on", "off"):
            llm.collective_rpc(switch_agreement, args=(setting == "on",))
            result = generate(prompt, chunks, 0.15)
            assert result["status"] == "fused", result
            blend[setting].append(result["blend_time_s"])
    llm.collective_rpc(switch_agreement, args=(True,))
    num_layers = counts[0]["num_layers"]
    report = {
        "model": str(model_dir), "tp_size": 2, "num_layers": num_layers, "status": stats["status"],
        "latency_us": latency,
        "agreements_per_request": counts[0]["agreements"],
        "agreements_per_layer": counts[0]["agreements"] / num_layers,
        "blend_time_ms": {k: [round(1e3 * t, 3) for t in v] for k, v in blend.items()},
        "blend_time_median_ms": {k: round(1e3 * statistics.median(v), 3) for k, v in blend.items()},
        "threads": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
    }
    print(json.dumps(report, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))


def time_all_reduces(worker, calls: int) -> dict:
    """In each worker: mean microseconds of one agreement and of the model's own all-reduces."""
    import time

    import torch
    from vllm.distributed import tensor_model_parallel_all_reduce
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group()._worker
    hidden = side.adapter.shape.hidden_size

    def mean_us(fn) -> float:
        for _ in range(50):
            fn()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return round(1e6 * (time.perf_counter() - start) / calls, 2)

    one_row, rows_64 = torch.ones(1, hidden), torch.ones(64, hidden)
    return {"agreement_1_pass": mean_us(lambda: side.pass_agreement([False])),
            "agreement_8_passes": mean_us(lambda: side.pass_agreement([False] * 8)),
            "model_all_reduce_1_row": mean_us(lambda: tensor_model_parallel_all_reduce(one_row)),
            "model_all_reduce_64_rows": mean_us(lambda: tensor_model_parallel_all_reduce(rows_64))}


def count_agreements(worker, start: bool) -> dict | None:
    """Wraps the worker's agreement with a counter (`start`), or reads and removes it."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group()._worker
    if start:
        agree = side.pass_agreement
        counter = {"agreements": 0}

        def counted(failed):
            counter["agreements"] += 1
            return agree(failed)

        counted.counter, counted.inner = counter, agree
        side.pass_agreement = side.passes.agree = counted
        return None
    counted = side.pass_agreement
    side.pass_agreement = side.passes.agree = counted.inner
    # The score sums are RankSum ops of the batch: they need no agreement of their own
    return {"agreements": counted.counter["agreements"], "num_layers": side.adapter.shape.num_layers}


def switch_agreement(worker, on: bool) -> None:
    """The PassBatch agreement on or off in this worker (off: what the blend cost before it)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group()._worker
    if not hasattr(side, "_benchmark_agreement"):
        side._benchmark_agreement = side.pass_agreement
    side.pass_agreement = side.passes.agree = side._benchmark_agreement if on else None


if __name__ == "__main__":
    main()

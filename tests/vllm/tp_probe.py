"""Runs one fused workload on an engine of a given tensor-parallel size; prints JSON results.

A script (not a test module) because TP > 1 spawns worker processes, which re-import __main__.
    python tests/vllm/tp_probe.py MODEL_DIR STORE_DIR TP_SIZE [MODE [DUMP_DIR]]

MODE "all" (default) stores chunks a and c and runs the prompt at ratio 1.0 and 0.15; "skip_a" never
stores a (a hole on every rank); "fault_rank1" stores both, then corrupts rank 1's entry of a only.
"midpass_loader", "midpass_select", "midpass_probe" and "midpass_start" make rank 1 alone raise in the
ratio-0.15 pass (its layer 2's loaded K/V; its check layer's selection, before the score sum; layer 1 of
the question probe of a fusionrag pass, between the probe's collectives; its keys, before it pins or reads
anything and before the ranks agree on hits), then run the prompt again; "midpass_unagreed" is "midpass_loader" with the ranks'
agreement during the pass switched off. With
DUMP_DIR, the workers write their stacks there (rank<r>.txt) while the fault is armed.
"""

import json
import os
import sys


def main() -> None:
    model_dir, store_dir, tp_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else "all"  # a damaged file is then read, not a memory copy
    dump_dir = sys.argv[5] if len(sys.argv) > 5 else None
    import torch
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(kv_connector="CacheFuseConnector", kv_connector_module_path="cachefuse.vllm.connector",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"store_dir": store_dir, "allow_sync_save": True,
                                                     # disk only in the fault modes:
                                                     **({} if mode == "all" else {"memory_capacity_bytes": 0})})
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
    if mode == "skip_a":
        runs = [runs[1], runs[3]]
    if mode.startswith("midpass"):
        runs.append(("again", *runs[3][1:]))
    for name, ids, chunks, ratio in runs:
        if name == "ratio_1" and mode == "fault_rank1":
            corrupt_rank_entry(model_dir, store_dir, a, tp_size, rank=1)
            continue
        if mode.startswith("midpass"):
            armed = name == "ratio_15"
            llm.collective_rpc(arm_fault, args=(mode if armed else None, dump_dir if armed else None))
        params = {"cachefuse": {"chunks": chunks, "recompute_ratio": ratio}}
        if mode == "midpass_probe" and name in ("ratio_15", "again"):
            params["cachefuse"]["selector"] = "fusionrag"  # a query-aware selector: the pass starts with a probe
        if name.startswith("precompute"):  # written before the answer, as `cachefuse precompute` asks: a
            params["cachefuse"]["sync_save"] = True  # fault mode then damages a file that is there
        sampling = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20,
                                  extra_args={"kv_transfer_params": params})
        (out,) = llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False)
        results[name] = {"logprobs": {str(t): lp.logprob for t, lp in out.outputs[0].logprobs[0].items()},
                         "stats": out.kv_transfer_params["cachefuse"]}
    # What the scheduler's index learned of the saves: rank 0's keys only (another rank's would match no row)
    index = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler.index
    results["index_keys"] = sorted(set(index._plain) | {r.store_key for r in index.records()})
    print("RESULT " + json.dumps(results), flush=True)


def arm_fault(worker, mode, dump_dir) -> None:
    """In a worker process: rank 1's next blend pass raises mid-pass (`mode`), once; None disarms. With
    `dump_dir`, every rank writes its threads' stacks there every 30 s until disarmed."""
    import faulthandler

    from vllm.distributed import get_tensor_model_parallel_rank

    from cachefuse.fusion import layers, probe
    from cachefuse.fusion.engine import FusionEngine
    from cachefuse.select import cacheblend

    if dump_dir:  # where each rank's threads stand, every 30 s while armed: a deadlock names its collective
        stacks = open(f"{dump_dir}/rank{get_tensor_model_parallel_rank()}.txt", "a")  # noqa: SIM115 - kept open
        faulthandler.dump_traceback_later(30, repeat=True, file=stacks)
    else:
        faulthandler.cancel_dump_traceback_later()
    state = {"armed": mode is not None and get_tensor_model_parallel_rank() == 1}
    original_rotated = getattr(layers.LoadedLayers, "_unfaulted_rotated", layers.LoadedLayers.rotated)
    original_deviation = getattr(cacheblend, "_unfaulted_deviation_partials", cacheblend.deviation_partials)
    original_attention = getattr(probe, "_unfaulted_rows_attention_at", probe.rows_attention_at)
    original_keys = getattr(FusionEngine, "_unfaulted_chunk_keys", FusionEngine._chunk_keys)
    layers.LoadedLayers._unfaulted_rotated, cacheblend._unfaulted_deviation_partials = original_rotated, original_deviation
    probe._unfaulted_rows_attention_at, FusionEngine._unfaulted_chunk_keys = original_attention, original_keys
    probe_layers = []

    def rotated(self, layer):
        if state["armed"] and mode in ("midpass_loader", "midpass_unagreed") and layer == 2:
            state["armed"] = False
            raise RuntimeError("injected: rank 1's loaded K/V of layer 2 unavailable")
        return original_rotated(self, layer)

    def deviation_partials(kv, metric):
        if state["armed"] and mode == "midpass_select":
            state["armed"] = False
            raise RuntimeError("injected: rank 1's selection failed before its score sum")
        return original_deviation(kv, metric)

    def rows_attention_at(*args, **kwargs):
        probe_layers.append(len(probe_layers))
        if state["armed"] and mode == "midpass_probe" and len(probe_layers) == 2:  # layer 0's output all-reduced
            state["armed"] = False
            raise RuntimeError("injected: rank 1's question probe failed in its layer 1")
        return original_attention(*args, **kwargs)

    def chunk_keys(self, *args, **kwargs):
        if state["armed"] and mode == "midpass_start":
            state["armed"] = False
            raise RuntimeError("injected: rank 1's pass failed at its start, before the ranks agree on hits")
        return original_keys(self, *args, **kwargs)

    layers.LoadedLayers.rotated, cacheblend.deviation_partials = rotated, deviation_partials
    probe.rows_attention_at, FusionEngine._chunk_keys = rows_attention_at, chunk_keys
    if mode == "midpass_unagreed":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        get_kv_transfer_group()._worker.pass_agreement = None
        get_kv_transfer_group()._worker.passes.agree = None


def corrupt_rank_entry(model_dir: str, store_dir: str, ids: list[int], tp_size: int, rank: int) -> None:
    """Flips a data byte of one rank's stored entry of the chunk `ids` (the other ranks' stay whole)."""
    from cachefuse.chunks import KeyContext, chunk_key, model_fingerprint
    from cachefuse.config import CacheFuseConfig

    config = CacheFuseConfig(store_dir=store_dir)
    ctx = KeyContext(model_fingerprint(model_dir), "float32", tp_size, rank, config.compute_hash())
    key = chunk_key(ids, ctx)
    path = config.kv_store_path(tp_size, rank) / key[:2] / f"{key}.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main()

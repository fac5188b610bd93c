"""In-process vLLM engines with and without CacheFuseConnector, and what tests read from them.

Import only from tests under tests/vllm (their conftest sets the in-process environment first).
"""

from __future__ import annotations

import contextlib
import gc
import math
from pathlib import Path
from typing import Any

ENGINE_ARGS = dict(dtype="float32", max_model_len=2048, enforce_eager=True, enable_prefix_caching=False,
                   async_scheduling=False, seed=0, kv_cache_memory_bytes=64 << 20, max_logprobs=20)


def start_engine(path: Path, store_dir: Path | None = None, engine_args: dict[str, Any] | None = None,
                 async_scheduling: bool = False, **extra_config: Any):
    """A plain engine (store_dir None) or one with CacheFuseConnector over `store_dir`; `engine_args`
    override ENGINE_ARGS (e.g. a KV cache small enough to preempt). `async_scheduling` starts it as a GPU
    engine starts by default (`as_on_a_gpu`): vLLM's CPU platform turns async scheduling off.

    The connector allows `sync_save`, as the engine of `cachefuse precompute` does: the test is its only
    client, and `precompute` below asks for it (pass allow_sync_save=False for a server's default)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if store_dir is not None:
        kv = KVTransferConfig(
            kv_connector="CacheFuseConnector", kv_connector_module_path="cachefuse.vllm.connector",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"store_dir": str(store_dir), "allow_sync_save": True, **extra_config})
    args = {**ENGINE_ARGS, **(engine_args or {})}
    if not async_scheduling:
        return LLM(model=str(path), kv_transfer_config=kv, **args)
    with async_scheduling_as_on_a_gpu():
        llm = LLM(model=str(path), kv_transfer_config=kv, **{**args, "async_scheduling": None})
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    return llm


@contextlib.contextmanager
def async_scheduling_as_on_a_gpu():
    """vLLM resolves async scheduling on (its default on GPUs) and the CPU platform turns it off again;
    within this block it stays on, and vLLM's CPU engine runs with it (AsyncScheduler, outputs one step
    behind)."""
    from vllm.platforms.cpu import CpuPlatform

    cpu_update = CpuPlatform.check_and_update_config.__func__

    def update_as_on_a_gpu(cls, vllm_config):
        cpu_update(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(update_as_on_a_gpu)
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = classmethod(cpu_update)


def stop_engine(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def scheduler_connector(llm):
    """The scheduler-side CacheFuseConnector of an in-process engine (its `.counters`)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def worker_side():
    """The worker half of the CacheFuseConnector living in this process (in-process engines)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker


def generate(llm, prompts: list[list[int]], params: list[dict | None], max_tokens: int = 1):
    """Greedy generation with top-20 logprobs per token; one kv_transfer_params per prompt."""
    from vllm import SamplingParams

    sampling = [SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=20, ignore_eos=True,
                               extra_args={"kv_transfer_params": p} if p is not None else None)
                for p in params]
    return llm.generate([{"prompt_token_ids": ids} for ids in prompts], sampling, use_tqdm=False)


def first_logprobs(output) -> dict[int, float]:
    return {token: lp.logprob for token, lp in output.outputs[0].logprobs[0].items()}


def max_logprob_diff(expected: dict[int, float], actual: dict[int, float]) -> float:
    """Largest |difference| over the expected top tokens (a token missing from `actual` counts as inf)."""
    return max(abs(lp - actual.get(token, -math.inf)) for token, lp in expected.items())


def random_pieces(seed: int, lengths: dict[str, int]) -> dict[str, list[int]]:
    """Seeded random ids (3..999, clear of the special tokens) per named prompt piece, e.g. system, a, question."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {name: torch.randint(3, 1000, (n,), generator=g).tolist() for name, n in lengths.items()}


def named_prompt(pieces: dict[str, list[int]], names, **overrides: Any) -> tuple[list[int], dict]:
    """The ids of `pieces[name]` for `names` in order, every piece but "question" declared as a chunk,
    and the request's kv_transfer_params (`overrides` join the chunks, e.g. selector)."""
    ids, chunks = [], []
    for name in names:
        if name != "question":
            chunks.append([len(ids), len(ids) + len(pieces[name])])
        ids += pieces[name]
    return ids, {"cachefuse": {"chunks": chunks, **overrides}}


def precompute(llm, system: list[int], chunks: list[list[int]]) -> list[dict]:
    """Stores the system prompt and each chunk (computed after the system prompt alone) as holes.

    Sends `sync_save` as `cachefuse precompute` does: the files exist when this returns, so a test that
    damages or removes one, or breaks the store next, never races the background writer.
    """
    prompts, params = [], []
    for chunk in chunks:
        prompts.append(system + chunk + [chunk[0]])  # one computed token after the last declared chunk
        params.append({"cachefuse": {"chunks": [[0, len(system)], [len(system), len(system) + len(chunk)]],
                                     "selector": "full_prefill", "sync_save": True}})
    outputs = generate(llm, prompts, params)
    return [o.kv_transfer_params["cachefuse"] for o in outputs]

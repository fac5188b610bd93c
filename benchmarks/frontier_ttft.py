"""The frontier's speed half: TTFT of cachefuse requests against plain vLLM on the same QA prompts.

One vLLM engine with CacheFuseConnector per *engine group* (the configurations whose connector
config is the same once the per-request fields, `selector` and `recompute_ratio`, are set aside),
each in its own subprocess, pinned as benchmarks/vllm_ttft.py pins its workers (`worker_env`: CPU
affinity, OMP_NUM_THREADS / OMP_PLACES / OMP_PROC_BIND, VLLM_CPU_OMP_THREADS_BIND; in-process engine).

Protocol per engine: every timed item's documents are stored as `cachefuse precompute` stores them
(each computed after the system prompt); each item is sent once fused and once plain (untimed: the
chunks reach the memory tier and the loading controller gets its first figures); then, item after
item, every configuration of the group in a seeded shuffled order: the prompt plain (no cachefuse
parameters: vLLM's own prefill in the same engine and process), then fused, each timed as the wall
time of `LLM.generate` with max_tokens=1. Plain and fused thus alternate request by request, so
machine noise hits both; a configuration's speed-up is the median over items of plain / fused
(paired), with a bootstrap 95% interval over items, beside the ratio of the medians.

The main process's side (the end of this module): which configurations share an engine
(`speed_groups`, `engine_overrides`), the name each is timed under (`speed_key`), one job per engine
(`measure_speed`), and timings of earlier runs joined (`earlier_speed`).

Each fused response's `kv_transfer_params` is kept: status (fused or fallen back, e.g. the
controller's no-go), the ratio it ran at, the controller's decision, rows selected, chunks hit.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from frontier_cli import check_layout

if TYPE_CHECKING:
    from frontier import Configuration

BOOTSTRAP_SAMPLES = 4000
KV_CACHE_BYTES = 256 << 20
MAX_MODEL_LEN = 2048


# --------------------------------------------------------------------------- worker (one engine)


def _generate(llm, token_ids: list[int], params: dict[str, Any] | None):
    from cachefuse.vllm.engines import sampling_params

    sampling = sampling_params(max_tokens=1, temperature=0.0, ignore_eos=True, cachefuse=params)
    (out,) = llm.generate([{"prompt_token_ids": token_ids}], sampling, use_tqdm=False)
    return out


def _timed(llm, token_ids: list[int], params: dict[str, Any] | None) -> tuple[float, Any]:
    begin = time.perf_counter()
    out = _generate(llm, token_ids, params)
    return time.perf_counter() - begin, out


def _outcome(out) -> dict[str, Any]:
    """What the response says about the fused request (the fields the frontier reads)."""
    status = (out.kv_transfer_params or {}).get("cachefuse", {})
    controller = status.get("controller") or {}
    return {"status": status.get("status"), "fallback_reason": status.get("fallback_reason"),
            "detail": (status.get("detail") or "")[:300] or None,
            "recompute_ratio": status.get("recompute_ratio"), "chunks": status.get("chunks"),
            "chunks_hit": status.get("chunks_hit"), "chunks_missed": status.get("chunks_missed"), "num_selected": status.get("num_selected"),
            "blend_time_s": status.get("blend_time_s"),
            "controller": {k: controller.get(k) for k in ("fuse", "verdict", "ratio")} if controller else None}


def run_worker(job: dict[str, Any]) -> dict[str, Any]:
    """One engine group's protocol in this process (see the module docstring); returns the raw figures."""
    import torch

    from cachefuse.offline.precompute import precompute_chunks
    from cachefuse.rag_prompt import build_rag_prompt
    from cachefuse.vllm.engines import connector_extra_config, connector_llm

    with tempfile.TemporaryDirectory(prefix="cachefuse-frontier-") as store_dir:
        extra, _ = connector_extra_config(Path(store_dir), **job["engine_overrides"])
        llm = connector_llm(job["model"], extra, dtype="float32", max_model_len=MAX_MODEL_LEN,
                            kv_cache_memory_bytes=KV_CACHE_BYTES)
        tokenizer = llm.get_tokenizer()
        items = job["items"]
        for system in dict.fromkeys(item["system"] for item in items):
            chunks = dict.fromkeys(c for item in items if item["system"] == system for c in item["chunks"])
            report = precompute_chunks(llm, tokenizer, system, chunks, store_dir=store_dir, progress=False)
            if report.num_failed:
                raise RuntimeError(f"precompute failed for {report.num_failed} chunk(s): {report.failures[:3]}")
        prompts = [build_rag_prompt(tokenizer, i["system"], i["chunks"], i["question"]) for i in items]
        requests = job["requests"]

        def params(prompt, request) -> dict[str, Any]:
            return {"chunks": [[s, e] for s, e in prompt.chunks], "selector": request["selector"],
                    "recompute_ratio": request["ratio"]}

        for prompt in prompts:  # warm-up: chunks into memory, first figures for the controller
            _generate(llm, prompt.token_ids, params(prompt, requests[0]))
            _generate(llm, prompt.token_ids, None)
        rows: dict[str, dict[str, list]] = {r["name"]: {"plain_s": [], "fused_s": [], "outcomes": []}
                                            for r in requests}
        rng = random.Random(job["seed"])
        for prompt in prompts:
            for request in rng.sample(requests, len(requests)):
                plain_s, _ = _timed(llm, prompt.token_ids, None)
                fused_s, out = _timed(llm, prompt.token_ids, params(prompt, request))
                row = rows[request["name"]]
                row["plain_s"].append(plain_s)
                row["fused_s"].append(fused_s)
                row["outcomes"].append(_outcome(out))
        llm.llm_engine.engine_core.shutdown()
    return {"requests": rows, "num_tokens": [len(p.token_ids) for p in prompts],
            "threads": {"torch_threads": torch.get_num_threads(), "affinity": sorted(os.sched_getaffinity(0))}}


def worker_main(job_path: Path, result_path: Path, cpus: str) -> None:
    from vllm_ttft import parse_cpus

    os.sched_setaffinity(0, parse_cpus(cpus))  # before torch starts its thread pool
    job = json.loads(job_path.read_text())
    result_path.write_text(json.dumps(run_worker(job)) + "\n")


# --------------------------------------------------------------------------- parent


def run_group(job: dict[str, Any], cpus: str, workdir: Path, timeout_s: int) -> dict[str, Any]:
    """Runs one engine group in a fresh, pinned subprocess (its own process group), bounded by `timeout_s`."""
    from vllm_ttft import parse_cpus, worker_env

    name = job["group"]
    job_path, result, log = (workdir / f"{name}.{ext}" for ext in ("job.json", "json", "log"))
    job_path.write_text(json.dumps(job))
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "frontier.py"), "--ttft-worker", str(job_path),
           "--ttft-result", str(result), "--cpus", cpus]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, env=worker_env(parse_cpus(cpus)), stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    if code != 0 or not result.is_file():
        reason = f"timed out after {timeout_s} s" if code is None else f"exited with {code}"
        tail = log.read_text(errors="replace")[-4000:]
        raise SystemExit(f"TTFT worker {name} {reason}; last lines of its log:\n{tail}")
    return json.loads(result.read_text())


def paired_speedup(plain_s: list[float], fused_s: list[float], seed: int) -> dict[str, Any]:
    """Median over items of plain / fused (each pair timed back to back), its bootstrap 95% interval over
    items, and the ratio of the medians."""
    import numpy as np

    ratios = np.asarray(plain_s) / np.asarray(fused_s)
    rng = np.random.default_rng(seed)
    medians = np.median(ratios[rng.integers(0, ratios.size, (BOOTSTRAP_SAMPLES, ratios.size))], axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return {"speedup": float(np.median(ratios)), "ci95": [float(low), float(high)],
            "ratio_of_medians": statistics.median(plain_s) / statistics.median(fused_s),
            "plain_ttft_s_median": statistics.median(plain_s), "fused_ttft_s_median": statistics.median(fused_s),
            "pairs": int(ratios.size)}


def decisions(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """How the requests ran: fused count, fallback reasons, and the ratios they ran at."""
    fused = [o for o in outcomes if o["status"] == "fused"]
    ratios = sorted({round(o["recompute_ratio"], 6) for o in fused if o["recompute_ratio"] is not None})
    verdicts = sorted({(o["controller"] or {}).get("verdict") for o in outcomes} - {None})
    details = [o["detail"] for o in outcomes if o["status"] != "fused" and o.get("detail")]
    return {"requests": len(outcomes), "fused": len(fused), "first_fallback_detail": details[0] if details else None, "ratios": ratios, "controller_verdicts": verdicts,
            "fallback_reasons": sorted({o["fallback_reason"] for o in outcomes if o["status"] != "fused"},
                                       key=str),
            "chunks_missed": sum(o["chunks_missed"] or 0 for o in fused),
            "num_selected_median": statistics.median(o["num_selected"] or 0 for o in fused) if fused else None}


# --------------------------------------------------------------------------- the grid's engines (main process)


PER_REQUEST_FIELDS = ("selector", "recompute_ratio")
"""Config fields a request may override (cachefuse.request): one engine serves every value of them."""


def engine_overrides(config: Configuration) -> dict[str, Any]:
    """The connector config one engine needs for `config`: its overrides but the per-request ones, and
    cachecraft's ratio as `force_cfo` (its ratio axis, as cachefuse.eval.harness.selector_at runs it)."""
    out = {k: v for k, v in config.overrides.items() if k not in PER_REQUEST_FIELDS}
    if config.overrides.get("selector") == "cachecraft":
        out["force_cfo"] = config.overrides["recompute_ratio"]
    return out


def speed_groups(configs: list[Configuration], all_axes) -> dict[str, list[Configuration]]:
    """Configurations timed in one engine: same connector config, and quality-only axes at their first value."""
    quality_only = {a.name: next(iter(a.values)) for a in all_axes if not a.moves_speed}
    groups: dict[str, list[Configuration]] = {}
    for config in configs:
        if any(config.label(a) != first for a, first in quality_only.items()):
            continue
        key = ",".join(f"{k}={v}" for k, v in sorted(engine_overrides(config).items())) or "defaults"
        groups.setdefault(key, []).append(config)
    return groups


def speed_key(config: Configuration, all_axes) -> str:
    """The name under which `config`'s speed was timed (quality-only axes at their first value)."""
    return "/".join(next(iter(a.values)) if not a.moves_speed else config.label(a.name) for a in all_axes)


def earlier_speed(paths: list[Path], layout: str) -> dict[str, dict]:
    """The timed configurations of earlier runs (a full run's JSON or a --speed-only one), later files winning
    where both timed a configuration (a share of the grid timed apart joins a run that lacks it)."""
    speed = {}
    for path in paths:
        earlier = json.loads(path.read_text())
        check_layout("--speed-from", path, earlier, layout)
        speed.update(earlier["configurations"] if "configurations" in earlier else earlier["speed"]["configurations"])
    return speed


def measure_speed(args, all_axes, configs, timed_items, reuse_host: Configuration) -> dict[str, dict]:
    """Per timed configuration (and full_reuse, in `reuse_host`'s engine): TTFTs, speed-up, decisions."""
    from tqdm.auto import tqdm

    groups = speed_groups(configs, all_axes)
    items = [{"system": i.system, "chunks": list(i.chunks), "question": i.question} for i in timed_items]
    out = {}
    with tempfile.TemporaryDirectory(prefix="frontier-ttft-") as workdir:
        for index, (key, members) in enumerate(tqdm(groups.items(), desc="TTFT through vLLM", unit="engine")):
            requests = [{"name": c.name, "selector": c.overrides["selector"], "ratio": c.overrides["recompute_ratio"]}
                        for c in members]
            if reuse_host in members:
                requests.append({"name": "full_reuse", "selector": "full_reuse", "ratio": 0.0})
            job = {"group": f"engine{index}", "model": str(args.model), "items": items, "requests": requests,
                   "engine_overrides": engine_overrides(members[0]), "seed": args.seed}
            raw = run_group(job, args.cpus, Path(workdir), args.timeout)
            for name, row in raw["requests"].items():
                out[name] = {"engine": key, "threads": raw["threads"], "prompt_tokens": raw["num_tokens"],
                             **paired_speedup(row["plain_s"], row["fused_s"], args.seed),
                             "decisions": decisions(row["outcomes"]), "plain_s": row["plain_s"],
                             "fused_s": row["fused_s"]}
    return out

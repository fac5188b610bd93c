"""TTFT and decode speed on vLLM (CPU): plain, prefix caching, cachefuse full_reuse and cacheblend 15%.

Model: the fusor_prefill model (12 layers, hidden 512, intermediate 1536, 8 heads of 64, 4 KV heads,
vocab 1024, random weights), float32, enforce_eager. Workload (seeded, identical in every
configuration): a 64-token system prompt shared by all requests, 8 chunks of 256 tokens drawn in a
shuffled order from a pool of 32, and a fresh 32-token question (2144 tokens). cachefuse requests
declare the system prompt [0, 64) and the 8 chunks; the question is computed.

Configurations, each in its own subprocess (this script re-invokes itself with --worker):

- plain: vLLM, prefix caching off;
- prefix_caching: vLLM with prefix caching on. Blocks hold 128 tokens, so the 64-token system prompt
  alone never fills one: a request hits the two blocks that the populate request of its first chunk
  left (256 tokens: the system prompt and the chunk's first 192), more only if an earlier request
  had the same first chunks;
- full_reuse, cacheblend: CacheFuseConnector (host-memory tier, prefix caching off).

Protocol per configuration: start the engine; populate (untimed): one `[system][chunk][1 token]`
request per pool chunk, sent with selector full_prefill to cachefuse, so the store holds every
chunk as computed after the system prompt (for prefix_caching it seeds the prefix cache; for plain
it is warm-up); --warmup untimed requests; then --requests timed requests with max_tokens=1, one at
a time: TTFT is the wall time of `LLM.generate`. plain and cacheblend then time --decode-requests
requests of --decode-tokens tokens (ignore_eos): decode tokens/s = (tokens - 1) / (total - TTFT),
with TTFT taken from vLLM's per-request first-token timestamp (log stats are on in every engine).

Threads: the engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), where vLLM binds nothing
(VLLM_CPU_OMP_THREADS_BIND is read only by the multiprocess executor's OMPProcessManager). Each
worker therefore gets what that manager gives a worker bound to --cpus: the CPU affinity, and
OMP_NUM_THREADS / OMP_PLACES / OMP_PROC_BIND; VLLM_CPU_OMP_THREADS_BIND is set to the same list.

Subprocesses cannot be paired run by run: speed-ups between configurations are ratios of medians,
with bootstrap 95% intervals over requests (they do not cover drift between subprocesses on a
shared machine). To see through that drift, the cachefuse workers also send each timed prompt
without cachefuse parameters right before the fused one (a plain vLLM prefill in the same engine
and process) and report the median of the per-pair ratios beside the ratio of medians.

    python benchmarks/vllm_ttft.py [--requests 16] [--cpus 0-1] [--out docs/benchmarks] [--replot]
    python benchmarks/vllm_ttft.py --model .cache/models/smollm2-135m-instruct --out /tmp/smollm2

`--model` runs the same workload (random ids below the model's vocabulary) on a local checkpoint.

Writes vllm_ttft.json and vllm_ttft.png under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fusor_prefill import bench_model  # noqa: E402

SYSTEM_LEN, NUM_CHUNKS, CHUNK_LEN, QUESTION_LEN, POOL_SIZE = 64, 8, 256, 32, 32
FIRST_ID = 4  # ids 0..3 are the tokenizer's <|bos|> <|eos|> <|pad|> <|unk|>
KV_CACHE_BYTES = 512 << 20
CONFIGS = {
    "plain": dict(label="(a) vLLM", prefix_caching=False, cachefuse=None),
    "prefix_caching": dict(label="(b) vLLM + prefix caching", prefix_caching=True, cachefuse=None),
    "full_reuse": dict(label="(c) cachefuse full_reuse", prefix_caching=False,
                       cachefuse=dict(selector="full_reuse", recompute_ratio=0.0, ratio_mode="fixed")),
    "cacheblend": dict(label="(d) cachefuse cacheblend 15%", prefix_caching=False,
                       cachefuse=dict(selector="cacheblend", recompute_ratio=0.15, ratio_mode="fixed")),
}
"""`ratio_mode: fixed` (not the default, the loading controller): each configuration measures the ratio its
label names; the results record the connector config they ran (`cachefuse_config`)."""
DECODE_CONFIGS = ("plain", "cacheblend")
TARGET_TTFT_SPEEDUP, TARGET_DECODE_RATIO = 2.5, 0.95
BOOTSTRAP_SAMPLES = 10000


# --------------------------------------------------------------------------- workload


def build_workload(seed: int, vocab_size: int, num_warmup: int, num_requests: int, num_decode: int) -> dict:
    """The seeded prompts every configuration sends, in order: populate, warm-up, timed, decode."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(FIRST_ID, vocab_size) for _ in range(n)]

    system = ids(SYSTEM_LEN)
    pool = [ids(CHUNK_LEN) for _ in range(POOL_SIZE)]
    tail = ids(1)

    def draw() -> dict:
        order = rng.sample(range(POOL_SIZE), NUM_CHUNKS)
        token_ids = system + [t for i in order for t in pool[i]] + ids(QUESTION_LEN)
        spans = [[0, SYSTEM_LEN]] + [[SYSTEM_LEN + j * CHUNK_LEN, SYSTEM_LEN + (j + 1) * CHUNK_LEN]
                                     for j in range(NUM_CHUNKS)]
        return dict(token_ids=token_ids, chunks=spans, order=order)

    populate = [dict(token_ids=system + chunk + tail, chunks=[[0, SYSTEM_LEN], [SYSTEM_LEN, SYSTEM_LEN + CHUNK_LEN]],
                     order=[i]) for i, chunk in enumerate(pool)]
    return dict(populate=populate, warmup=[draw() for _ in range(num_warmup)],
                timed=[draw() for _ in range(num_requests)], decode=[draw() for _ in range(num_decode)])


# --------------------------------------------------------------------------- worker (one engine)


def start_engine(name: str, model_dir: Path, store_dir: str):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    spec = CONFIGS[name]
    kwargs = dict(model=str(model_dir), dtype="float32", max_model_len=4096, enforce_eager=True, seed=0,
                  kv_cache_memory_bytes=KV_CACHE_BYTES, enable_prefix_caching=spec["prefix_caching"],
                  disable_log_stats=False)
    if spec["cachefuse"] is not None:
        extra = dict(spec["cachefuse"], store_dir=store_dir, disk_capacity_bytes=0)
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="CacheFuseConnector", kv_connector_module_path="cachefuse.vllm.connector",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    return LLM(**kwargs)


def generate(llm, request: dict, max_tokens: int, cachefuse: bool, selector: str | None = None):
    from vllm import SamplingParams

    extra = None
    if cachefuse:
        params = {"chunks": request["chunks"]}
        if selector is not None:
            params["selector"] = selector
        extra = {"kv_transfer_params": {"cachefuse": params}}
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
    (out,) = llm.generate([{"prompt_token_ids": request["token_ids"]}], sampling, use_tqdm=False)
    return out


def request_record(out) -> dict:
    record = dict(num_cached_tokens=out.num_cached_tokens, num_output_tokens=len(out.outputs[0].token_ids))
    params = out.kv_transfer_params or {}
    if "cachefuse" in params:
        record["cachefuse"] = dict(params["cachefuse"])
    return record


def run_worker(name: str, args: argparse.Namespace, model_dir: Path, vocab_size: int) -> dict:
    """Runs one configuration's protocol in this process and returns its raw figures."""
    workload = build_workload(args.seed, vocab_size, args.warmup, args.requests, args.decode_requests)
    cachefuse = CONFIGS[name]["cachefuse"] is not None
    with tempfile.TemporaryDirectory(prefix="cachefuse-ttft-") as store_dir:
        start = time.perf_counter()
        llm = start_engine(name, model_dir, store_dir)
        import torch

        startup_s = time.perf_counter() - start
        for request in workload["populate"]:
            generate(llm, request, 1, cachefuse, selector="full_prefill")
        for request in workload["warmup"]:
            generate(llm, request, 1, cachefuse)
            if cachefuse:
                generate(llm, request, 1, cachefuse=False)
        timed = time_ttft(llm, workload, cachefuse)
        decode = time_decode(llm, workload, args.decode_tokens, cachefuse) if name in DECODE_CONFIGS else None
        config = llm.llm_engine.vllm_config
        engine = dict(block_size=config.cache_config.block_size,
                      max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
                      enable_prefix_caching=config.cache_config.enable_prefix_caching,
                      executor=type(llm.llm_engine.model_executor).__name__)
        threads = dict(torch_threads=torch.get_num_threads(), affinity=sorted(os.sched_getaffinity(0)),
                       env=recorded_env({k: os.environ.get(k) for k in THREAD_ENV}))
        llm.llm_engine.engine_core.shutdown()
    return dict(config=name, startup_s=startup_s, **timed, decode=decode, engine=engine, threads=threads)


def time_ttft(llm, workload: dict, cachefuse: bool) -> dict:
    """TTFT of each timed request; with cachefuse, each is paired with the same prompt sent without
    cachefuse parameters right before it (plain vLLM prefill in the same engine and process)."""
    ttft, records, paired = [], [], []
    for request in workload["timed"]:
        if cachefuse:
            begin = time.perf_counter()
            generate(llm, request, 1, cachefuse=False)
            paired.append(time.perf_counter() - begin)
        begin = time.perf_counter()
        out = generate(llm, request, 1, cachefuse)
        ttft.append(time.perf_counter() - begin)
        records.append(request_record(out))
    return dict(ttft_s=ttft, requests=records, paired_plain_ttft_s=paired or None)


def time_decode(llm, workload: dict, num_tokens: int, cachefuse: bool) -> dict:
    """Decode tokens/s per request: (tokens - 1) / (total - TTFT), TTFT from vLLM's first-token time.

    In a cachefuse engine each fused request is paired with the same prompt sent plainly to the same
    engine right before it, which isolates what fusing does to decode from drift between subprocesses.
    """
    generate(llm, workload["warmup"][0], num_tokens, cachefuse)
    rows = []
    for request in workload["decode"]:
        row = decode_once(llm, request, num_tokens, cachefuse)
        if cachefuse:
            row["paired_plain_tokens_per_s"] = decode_once(llm, request, num_tokens, False)["tokens_per_s"]
        rows.append(row)
    result = dict(tokens_per_s=[r["tokens_per_s"] for r in rows], requests=rows)
    if cachefuse:
        result["paired_ratio"] = statistics.median(r["tokens_per_s"] / r["paired_plain_tokens_per_s"] for r in rows)
    return result


def decode_once(llm, request, num_tokens: int, cachefuse: bool) -> dict:
    submitted = time.monotonic()  # the engine's timestamps are time.monotonic() of this process
    out = generate(llm, request, num_tokens, cachefuse)
    finished = time.monotonic()
    if out.metrics is None:
        raise RuntimeError("RequestOutput.metrics is None: the engine must run with log stats on")
    first = out.metrics.first_token_ts
    tokens = len(out.outputs[0].token_ids)
    return dict(tokens=tokens, total_s=finished - submitted, ttft_s=first - submitted,
                tokens_per_s=(tokens - 1) / (finished - first), **request_record(out))


# --------------------------------------------------------------------------- parent (all engines)

THREAD_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND",
              "VLLM_ENABLE_V1_MULTIPROCESSING", "LD_PRELOAD")


def recorded_env(env) -> dict:
    """The threading variables as the results record them: paths inside the repository relative to it (a
    committed result names no one's checkout)."""
    root = str(Path(__file__).resolve().parents[1]) + os.sep
    return {k: (v.replace(root, "") if isinstance(v, str) else v) for k, v in env.items() if k in THREAD_ENV}


def parse_cpus(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return sorted(set(cpus))


def worker_env(cpus: list[int]) -> dict[str, str]:
    """The environment of every worker: in-process engine, identical binding, no hub."""
    env = dict(os.environ)
    listed = ",".join(map(str, cpus))
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=listed,
               OMP_NUM_THREADS=str(len(cpus)), OMP_PLACES=f"{{{listed}}}", OMP_PROC_BIND="true",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the size is passed to LLM() explicitly
    return env


def run_config(name: str, args: argparse.Namespace, workdir: Path) -> dict:
    """Runs one configuration in a fresh subprocess (its own process group), bounded by --timeout."""
    result, log = workdir / f"{name}.json", workdir / f"{name}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--result", str(result),
           "--requests", str(args.requests), "--warmup", str(args.warmup), "--seed", str(args.seed),
           "--decode-requests", str(args.decode_requests), "--decode-tokens", str(args.decode_tokens),
           "--cpus", args.cpus, "--model-cache", str(args.model_cache)] + (
               ["--model", str(args.model)] if args.model is not None else [])
    start = time.perf_counter()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, env=worker_env(parse_cpus(args.cpus)), stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    tail = log.read_text(errors="replace")[-4000:]
    if code != 0 or not result.is_file():
        reason = f"timed out after {args.timeout} s" if code is None else f"exited with {code}"
        raise SystemExit(f"worker {name} {reason}; last lines of its log:\n{tail}")
    print(f"{name:15s} done in {time.perf_counter() - start:5.1f} s", flush=True)
    return json.loads(result.read_text())


def bootstrap_ratio(num: list[float], den: list[float], seed: int) -> list[float]:
    """95% interval of median(num) / median(den), resampling each list's values independently."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a, b = np.asarray(num), np.asarray(den)
    med_a = np.median(a[rng.integers(0, len(a), (BOOTSTRAP_SAMPLES, len(a)))], axis=1)
    med_b = np.median(b[rng.integers(0, len(b), (BOOTSTRAP_SAMPLES, len(b)))], axis=1)
    low, high = np.percentile(med_a / med_b, [2.5, 97.5])
    return [float(low), float(high)]


def cachefuse_summary(records: list[dict]) -> dict | None:
    stats = [r["cachefuse"] for r in records if "cachefuse" in r]
    if not stats:
        return None
    fallbacks = [s for s in stats if s.get("status") != "fused" or s.get("fallback_reason")]
    return dict(requests=len(stats), fused=len(stats) - len(fallbacks),
                fallbacks=[{k: s.get(k) for k in ("status", "fallback_reason", "detail")} for s in fallbacks],
                chunks_hit=statistics.median(s.get("chunks_hit", 0) for s in stats),
                chunks_missed=max(s.get("chunks_missed", 0) for s in stats),
                tokens_recomputed=statistics.median(s.get("tokens_recomputed", 0) for s in stats),
                blend_time_s=statistics.median(s.get("blend_time_s", 0.0) for s in stats))


def summarize(raw: dict[str, dict], args: argparse.Namespace) -> dict:
    configs = {}
    for name, run in raw.items():
        configs[name] = dict(label=CONFIGS[name]["label"], cachefuse_config=CONFIGS[name]["cachefuse"],
                             median_ttft_s=statistics.median(run["ttft_s"]),
                             cachefuse_summary=cachefuse_summary(run["requests"]), **run)
        paired = run["paired_plain_ttft_s"]
        if paired:
            configs[name]["paired_in_engine_plain"] = dict(
                median_ttft_s=statistics.median(paired),
                speedup=statistics.median(p / t for p, t in zip(paired, run["ttft_s"], strict=True)))
    speedups = {}
    for name in configs:
        for base in ("plain", "prefix_caching"):
            if name != base and base in configs:
                a, d = configs[base]["ttft_s"], configs[name]["ttft_s"]
                speedups[f"{name}_vs_{base}"] = dict(
                    ratio_of_medians=statistics.median(a) / statistics.median(d),
                    ci95=bootstrap_ratio(a, d, args.seed))
    decode = None
    if all(name in configs and configs[name]["decode"] for name in DECODE_CONFIGS):
        a, d = (configs[n]["decode"]["tokens_per_s"] for n in DECODE_CONFIGS)
        decode = dict(median_tokens_per_s={n: statistics.median(configs[n]["decode"]["tokens_per_s"])
                                           for n in DECODE_CONFIGS},
                      ratio_cacheblend_vs_plain=statistics.median(d) / statistics.median(a),
                      ci95=bootstrap_ratio(d, a, args.seed), tokens=args.decode_tokens,
                      paired_ratio_same_engine=configs["cacheblend"]["decode"].get("paired_ratio"))
    targets = {}
    for base in ("plain", "prefix_caching"):
        key = f"cacheblend_vs_{base}"
        if key in speedups:
            targets[f"ttft_{key}_at_least_{TARGET_TTFT_SPEEDUP}x"] = speedups[key]["ratio_of_medians"] >= TARGET_TTFT_SPEEDUP
    if decode:
        targets[f"decode_ratio_at_least_{TARGET_DECODE_RATIO}"] = decode["ratio_cacheblend_vs_plain"] >= TARGET_DECODE_RATIO
    from importlib.metadata import version

    cpus = parse_cpus(args.cpus)
    seen = {json.dumps([run["threads"]["torch_threads"], run["threads"]["affinity"]]) for run in raw.values()}
    if len(seen) != 1:
        raise SystemExit(f"workers ran with different threads or affinity: {sorted(seen)}")
    return dict(
        benchmark="vllm_ttft", seed=args.seed,
        protocol=dict(populate=POOL_SIZE, warmup=args.warmup, requests=args.requests,
                      decode_requests=args.decode_requests, decode_tokens=args.decode_tokens,
                      paired_in_engine_plain=True, bootstrap_samples=BOOTSTRAP_SAMPLES),
        threads=dict(cpus=cpus, num_threads=len(cpus), engine_mode="in-process",
                     env=recorded_env(worker_env(cpus))),
        machine=dict(cpu_count=os.cpu_count(), platform=platform.platform(), torch=version("torch"),
                     vllm=version("vllm-cpu")),
        model=dict(bench_model(args.model, args.model_cache)[1], dtype="float32", enforce_eager=True, kv_cache_memory_bytes=KV_CACHE_BYTES),
        workload=dict(system=SYSTEM_LEN, chunks=NUM_CHUNKS, chunk_len=CHUNK_LEN, pool=POOL_SIZE,
                      question=QUESTION_LEN, num_tokens=SYSTEM_LEN + NUM_CHUNKS * CHUNK_LEN + QUESTION_LEN,
                      first_token_id=FIRST_ID),
        configs=configs, speedups=speedups, decode=decode, targets=targets)


def report(result: dict) -> None:
    for c in result["configs"].values():
        line = f"{c['label']:30s} median TTFT {c['median_ttft_s'] * 1e3:7.1f} ms"
        summary = c["cachefuse_summary"]
        if summary:
            line += (f"  fused {summary['fused']}/{summary['requests']}, chunks hit {summary['chunks_hit']}, "
                     f"rows recomputed {summary['tokens_recomputed']}, blend {summary['blend_time_s'] * 1e3:.0f} ms")
        cached = [r["num_cached_tokens"] for r in c["requests"]]
        print(line + f"  cached tokens {min(cached)}..{max(cached)}")
        paired = c.get("paired_in_engine_plain")
        if paired:
            print(f"{'':30s} paired plain request in the same engine {paired['median_ttft_s'] * 1e3:7.1f} ms: "
                  f"{paired['speedup']:.2f}x (median of per-pair ratios)")
    for key, s in result["speedups"].items():
        print(f"{key:30s} {s['ratio_of_medians']:5.2f}x  (95% CI {s['ci95'][0]:.2f}..{s['ci95'][1]:.2f})")
    if result["decode"]:
        d = result["decode"]
        print(f"decode, fused vs plain requests in the same cachefuse engine (paired): "
              f"{d.get('paired_ratio_same_engine') or float('nan'):.3f}")
        print(f"decode tok/s {d['median_tokens_per_s']}; cacheblend / plain {d['ratio_cacheblend_vs_plain']:.3f} "
              f"(95% CI {d['ci95'][0]:.3f}..{d['ci95'][1]:.3f})")
    print(f"targets: {result['targets']}; threads: cpus {result['threads']['cpus']}, in-process engines")


def tick_label(name: str) -> str:
    return CONFIGS[name]["label"].replace(" ", "\n", 1).replace(" cacheblend", "\ncacheblend").replace(
        " full_reuse", "\nfull_reuse").replace(" + ", "\n+ ")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = result["configs"]
    fig, (ax, ax_dec) = plt.subplots(1, 2, figsize=(9.6, 4.6), gridspec_kw=dict(width_ratios=[2.2, 1]))
    names = list(configs)
    medians = [1e3 * configs[n]["median_ttft_s"] for n in names]
    bars = ax.bar(range(len(names)), medians, color=[f"C{i}" for i in range(len(names))])
    for name, bar in zip(names, bars, strict=True):
        note = f"{bar.get_height():.0f} ms"
        for base, tag in (("plain", "(a)"), ("prefix_caching", "(b)")):
            speedup = result["speedups"].get(f"{name}_vs_{base}")
            if speedup and (base == "plain" or name == "cacheblend"):
                note += f"\n{speedup['ratio_of_medians']:.2f}x vs {tag}"
        paired = configs[name].get("paired_in_engine_plain")
        if paired:
            note += f"\n{paired['speedup']:.2f}x paired"
        ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8)
    if "plain" in configs:
        target = 1e3 * configs["plain"]["median_ttft_s"] / TARGET_TTFT_SPEEDUP
        ax.axhline(target, color="grey", ls="--", lw=0.8, label=f"{TARGET_TTFT_SPEEDUP}x faster than (a): target")
        ax.legend(loc="upper right", fontsize=7, frameon=False)
    ax.set_xticks(range(len(names)), [tick_label(n) for n in names], fontsize=8)
    ax.set_ylabel("median TTFT (ms, max_tokens=1)")
    ax.set_ylim(0, 1.3 * max(medians))
    num_threads = result["threads"]["num_threads"]
    ax.set_title(f"vLLM CPU, 2144-token RAG prompt, {num_threads} pinned thread{'s' * (num_threads > 1)}",
                 fontsize=10)
    decode = result.get("decode")
    if decode:
        rates = [decode["median_tokens_per_s"][n] for n in DECODE_CONFIGS]
        ax_dec.bar([0, 1], rates, color=["C0", "C3"])
        ax_dec.axhline(TARGET_DECODE_RATIO * rates[0], color="grey", ls="--", lw=0.8,
                       label=f"{TARGET_DECODE_RATIO:.0%} of (a): target")
        ax_dec.legend(loc="lower center", fontsize=7, frameon=True)
        ax_dec.set_xticks([0, 1], [tick_label(n) for n in DECODE_CONFIGS], fontsize=8)
        low, high = decode["ci95"]
        ax_dec.set_title(f"decode: (d)/(a) = {decode['ratio_cacheblend_vs_plain']:.3f}\n"
                         f"(95% CI {low:.3f}..{high:.3f}; target >= {TARGET_DECODE_RATIO})", fontsize=10)
        ax_dec.set_ylabel(f"median decode tokens/s ({decode['tokens']} tokens)")
    fig.text(0.01, 0.01, "paired: median of per-pair ratios against the same prompt sent without cachefuse "
             "parameters to the same engine", fontsize=7, color="grey")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help="timed TTFT requests per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--decode-requests", type=int, default=12)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpus", default=",".join(map(str, sorted(os.sched_getaffinity(0)))),
                        help="CPUs every engine is bound to, e.g. 0-1 (default: all this process may use)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per configuration subprocess")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--model-cache", type=Path, default=REPO / ".cache" / "bench-models")
    parser.add_argument("--model", type=Path, default=None,
                        help="a local checkpoint instead of the random 12-layer model (give it its own --out)")
    parser.add_argument("--replot", action="store_true", help="redraw the plot from the JSON in --out")
    parser.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.requests < 1 or args.warmup < 1 or args.decode_requests < 1 or args.decode_tokens < 2:
        parser.error("--requests, --warmup and --decode-requests must be >= 1, --decode-tokens >= 2")
    if args.replot:
        plot(json.loads((args.out / "vllm_ttft.json").read_text()), args.out / "vllm_ttft.png")
        return
    if args.worker:
        os.sched_setaffinity(0, parse_cpus(args.cpus))  # before torch starts its thread pool
        model_dir, shape = bench_model(args.model, args.model_cache)
        args.result.write_text(json.dumps(run_worker(args.worker, args, model_dir, shape["vocab_size"])) + "\n")
        return
    names = [n for n in args.configs.split(",") if n]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; expected some of {list(CONFIGS)}")
    bench_model(args.model, args.model_cache)  # built once, before the workers start
    with tempfile.TemporaryDirectory(prefix="vllm-ttft-") as workdir:
        raw = {name: run_config(name, args, Path(workdir)) for name in names}
    result = summarize(raw, args)
    report(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vllm_ttft.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "vllm_ttft.png")


if __name__ == "__main__":
    main()

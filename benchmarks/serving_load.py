"""Serving under load: vLLM's OpenAI server plain and with cachefuse, both with vLLM's defaults (prefix
caching on), under Poisson arrivals and a closed loop of clients, measured the way `vllm bench serve`
measures serving.

Configurations, one server each, started one after another in one run, alike but for these flags:

    plain                   none: vLLM's defaults, prefix caching on (a deployment before cachefuse)
    plain_no_prefix_cache   --no-enable-prefix-caching (a reference: what vLLM's own cache gives)
    cachefuse               --kv-transfer-config for CacheFuseConnector, prefix caching on as in plain; its
                            extra config is DEFAULT_CACHEFUSE, a temporary store_dir, and --cachefuse-config
                            '{json}' merged over them (unknown keys pass through to the connector, which
                            rejects those it does not know)

Results written before prefix caching and cachefuse ran together named the configurations differently
(plain without prefix caching, plain_prefix_cache with it, cachefuse without it); each result's
server_args say which flags its servers had, and the report reads both.

Workload (benchmarks/rag_load.py): a 24-token system prompt, --docs-per-prompt documents of a pool of
--num-docs (lengths set by --model-size) in a random order, a 10-token question, token-id prompts; with
probability 1 - hit rate one document is never-seen (a miss for cachefuse). --output-len tokens, greedy,
ignore_eos. Before measuring, every server receives one request per pool document (system + document;
cachefuse stores them with selector full_prefill, prefix caching may keep them), so the servers' histories
match. Every configuration gets the same prompts and arrival times (seeded per load point).

Per configuration: (a) idle TTFT, --idle-requests single requests one at a time (median); plain's median
times --slo-factor is the TTFT SLO of every configuration; (b) for each --hit-rates, a Poisson sweep over
--rates (requests/s): --warmup seconds not measured, then --duration seconds measured; requests still
running --drain seconds after the last arrival are cancelled and count as errors; (c) a closed loop of
--clients clients for --warmup + --duration seconds, hits only.

Each load point reports completed requests, errors, throughput (requests/s, output tokens/s), TTFT,
ITL and end-to-end latency p50/p99, goodput (requests/s within the TTFT SLO) and the server's counter
deltas over the point, warm-up included (cachefuse's by name, fallbacks by reason, preemptions, prefix
cache hits). The figures are vLLM's own: `vllm.benchmarks.serve.calculate_metrics`
(benchmarks/load_metrics.py) over the `RequestFuncOutput`s of its streaming client; the arrival times
are drawn in benchmarks/rag_load.py (its docstring says why not by vLLM's get_request). A rate is
sustained when it had no errors and its TTFT p99 is within the SLO; the maximum sustained rate is the
highest swept rate sustained along with every lower one. Servers run under tcmalloc by default
(`--allocator`, as in benchmarks/soak.py).

    python benchmarks/serving_load.py [--quick] [--model-size bench|tiny] [--rates 1,2,4,6,8,12]
        [--hit-rates 1.0,0.5] [--duration 60] [--clients 16] [--cachefuse-config '{"recompute_ratio": 0.15}']
        [--allocator tcmalloc|glibc|jemalloc] [--out docs/benchmarks/serving_load]

--quick: the tiny model, rates 2,4, hit rate 1.0, 8 s points, 4 clients (a smoke run of a few minutes);
flags given with it still win. Writes serving_load.json (every figure, the command line, the machine, the
configurations) and serving_load.png (TTFT p99 and ITL p99 against rate) under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import shutil
import statistics
import sys
import tempfile
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

import rag_load  # noqa: E402
import vllm_server  # noqa: E402
from load_metrics import max_sustained_rate, point_metrics, ratios_over_plain, sustains  # noqa: E402
from load_report import plot, print_summary  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

if TYPE_CHECKING:
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

RunT = TypeVar("RunT")
CONFIGURATIONS = ("plain", "plain_no_prefix_cache", "cachefuse")
DEFAULT_CACHEFUSE = {
    # fixed, not the default loading controller: the committed runs measured the fixed 15%; the mode is in
    # each configuration's server_args (its --kv-transfer-config). --cachefuse-config '{"ratio_mode":
    # "controller"}' measures the default.
    "selector": "cacheblend", "recompute_ratio": 0.15, "ratio_mode": "fixed",
    "memory_capacity_bytes": 256 << 20,  # the bench model's 12 documents take ~75 MiB: they stay while misses come and go
    "disk_capacity_bytes": 0,  # memory only: a miss's save would otherwise be disk I/O the plain servers never do
}
KV_CACHE_BYTES = {  # room for 64 (--max-num-seqs) of the longest prompts: no preemption at the defaults
    "tiny": 64 << 20,  # 2 KiB per token: 32 K tokens
    "bench": 3 << 29,  # 24 KiB per token: 64 K tokens
}
QUICK = dict(model_size="tiny", rates="2,4", hit_rates="1.0", duration=8.0, warmup=2.0, drain=10.0, clients=4,
             idle_requests=3)


@dataclass(frozen=True)
class Configuration:
    name: str
    server_args: list[str]
    fused: bool


@dataclass
class PointRun:
    """One load point as measured: its measured requests' records, window and the server's counter deltas."""

    kind: str  # "poisson" or "closed_loop"
    hit_rate: float
    rate: float | None
    outputs: list[RequestFuncOutput] = field(default_factory=list)
    duration_s: float = 0.0
    server: dict[str, float] = field(default_factory=dict)


@dataclass
class ConfigurationRun:
    configuration: Configuration
    idle_ttft_s: list[float] = field(default_factory=list)
    points: list[PointRun] = field(default_factory=list)
    server_metrics: dict[str, float] = field(default_factory=dict)
    response_stats: dict = field(default_factory=dict)


def configurations(args, store_dir: Path) -> list[Configuration]:
    common = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs)]
    connector = {**DEFAULT_CACHEFUSE, "store_dir": str(store_dir), **args.cachefuse_config}
    every = {  # plain and cachefuse leave prefix caching to vLLM's default (on)
        "plain": Configuration("plain", common, fused=False),
        "plain_no_prefix_cache": Configuration("plain_no_prefix_cache", [*common, "--no-enable-prefix-caching"],
                                               fused=False),
        "cachefuse": Configuration("cachefuse", [*common, "--kv-transfer-config",
                                                 vllm_server.kv_transfer_config(connector)], fused=True),
    }
    return [every[name] for name in args.configs]


# ------------------------------------------------------------------------------------------ the server


def completion_body(prompt: rag_load.RagPrompt, fused: bool, max_tokens: int, **cachefuse) -> dict:
    body = {"model": vllm_server.SERVED_MODEL_NAME, "prompt": prompt.ids, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True}
    if fused:
        body["kv_transfer_params"] = {"cachefuse": {"chunks": prompt.chunks, **cachefuse}}
    return body


def store_documents(port: int, workload: rag_load.RagWorkload, fused: bool) -> None:
    """One request per pool document; cachefuse computes each in full and stores it (`cachefuse precompute`)."""
    for prompt in workload.storing_prompts():
        status, raw = vllm_server.request(port, "POST", "/v1/completions",
                                          completion_body(prompt, fused, 1, selector="full_prefill"))
        if status != 200:
            raise RuntimeError(f"storing a document failed: {status} {raw[:300]!r}")


def response_stats(port: int, workload: rag_load.RagWorkload, fused: bool, output_len: int) -> dict:
    """A non-streamed hit and miss: what the response's kv_transfer_params say (streamed ones carry none)."""
    rng = random.Random("response-stats")
    stats = {}
    for kind, hit in (("hit", True), ("miss", False)):
        status, raw = vllm_server.request(port, "POST", "/v1/completions",
                                          completion_body(workload.prompt(rng, hit), fused, output_len))
        stats[kind] = json.loads(raw).get("kv_transfer_params") if status == 200 else {"http_status": status}
    return stats


# ------------------------------------------------------------------------------------------ the load


def measured(run: rag_load.Run, warmup_s: float) -> tuple[list[RequestFuncOutput], float]:
    """The records of requests sent after the warm-up, and the window from the warm-up's end to the run's end."""
    return [sent.output for sent in run.sent if sent.at_s >= warmup_s], run.elapsed_s - warmup_s


def run_counted(port: int, load: Coroutine[Any, Any, RunT]) -> tuple[RunT, dict[str, float]]:
    """Runs `load` against the server: what it returns and the server's counter deltas over it; returns
    once the server is idle again."""
    before = vllm_server.server_counters(port)
    run = asyncio.run(load)
    deltas = vllm_server.counter_deltas(before, vllm_server.server_counters(port))
    vllm_server.wait_until_idle(port)
    return run, deltas


def measure(port: int, point: PointRun, load: Coroutine[Any, Any, rag_load.Run], warmup_s: float) -> PointRun:
    """Runs `load` against the server and fills `point` with its measured requests, window and the server's
    counter deltas."""
    run, point.server = run_counted(port, load)
    point.outputs, point.duration_s = measured(run, warmup_s)
    return point


def poisson_point(port: int, target: rag_load.Target, workload: rag_load.RagWorkload, rate: float,
                  hit_rate: float, args) -> PointRun:
    seed = f"{args.seed}/poisson/{rate}/{hit_rate}"  # the same arrivals and prompts for every configuration
    arrivals = rag_load.poisson_arrivals(rate, args.warmup + args.duration, seed)
    rng = random.Random(seed)
    prompts = [workload.draw(rng, hit_rate) for _ in arrivals]
    with tqdm(total=len(arrivals), desc=f"  {rate:g} req/s, hits {hit_rate:g}", leave=False) as pbar:
        return measure(port, PointRun("poisson", hit_rate, rate),
                       rag_load.open_loop(target, prompts, arrivals, args.drain, pbar), args.warmup)


def closed_loop_point(port: int, target: rag_load.Target, workload: rag_load.RagWorkload, args) -> PointRun:
    rngs = [random.Random(f"{args.seed}/closed/{client}") for client in range(args.clients)]
    with tqdm(desc=f"  {args.clients} clients", leave=False) as pbar:
        load = rag_load.closed_loop(target, lambda client: workload.prompt(rngs[client], hit=True), args.clients,
                                    args.warmup + args.duration, args.drain, pbar)
        return measure(port, PointRun("closed_loop", hit_rate=1.0, rate=None), load, args.warmup)


def idle_ttft(target: rag_load.Target, workload: rag_load.RagWorkload, args) -> list[float]:
    rng = random.Random(f"{args.seed}/idle")
    outputs = asyncio.run(rag_load.one_at_a_time(
        target, [workload.prompt(rng, hit=True) for _ in range(args.idle_requests)]))
    failed = [o.error for o in outputs if not o.success]
    if failed:
        raise RuntimeError(f"idle requests failed: {failed[0][-500:]}")
    return [o.ttft for o in outputs]


@contextlib.contextmanager
def serving(configuration: Configuration, model_dir: Path, args) -> Iterator[tuple[int, str]]:
    """The configuration's server with the run's model, KV cache and allocator: (port, completions URL);
    stopped on the way out, its log named if the body failed."""
    log = Path(tempfile.mkdtemp(prefix=f"cachefuse-serving-load-{configuration.name}-")) / "server.log"
    process, port = vllm_server.start_server(model_dir, log, args.kv_cache_bytes, configuration.server_args,
                                             args.allocator_library)
    try:
        yield port, f"http://127.0.0.1:{port}/v1/completions"
    except Exception:
        print(f"{configuration.name}: server log {log}", file=sys.stderr)
        raise
    finally:
        vllm_server.stop_server(process)


def run_configuration(configuration: Configuration, model_dir: Path, workload: rag_load.RagWorkload, args,
                      progress: tqdm) -> ConfigurationRun:
    """Starts the configuration's server, stores the documents, runs (a), (b), (c), and stops it."""
    progress.set_description(f"{configuration.name}: starting")
    result = ConfigurationRun(configuration)
    with serving(configuration, model_dir, args) as (port, url):
        target = rag_load.Target(url, vllm_server.SERVED_MODEL_NAME, configuration.fused, args.output_len)
        store_documents(port, workload, configuration.fused)
        progress.set_description(f"{configuration.name}: idle TTFT")
        result.idle_ttft_s = idle_ttft(target, workload, args)
        progress.update()
        for hit_rate in args.hit_rates:
            for rate in args.rates:
                progress.set_description(f"{configuration.name}: {rate:g} req/s, hits {hit_rate:g}")
                result.points.append(poisson_point(port, target, workload, rate, hit_rate, args))
                progress.update()
        progress.set_description(f"{configuration.name}: closed loop")
        result.points.append(closed_loop_point(port, target, workload, args))
        progress.update()
        result.server_metrics = vllm_server.server_counters(port)
        result.response_stats = response_stats(port, workload, configuration.fused, args.output_len)
    return result


# ------------------------------------------------------------------------------------------ the report


def point_summary(point: PointRun, slo_ttft_ms: float) -> dict:
    summary = {"rate": point.rate, "hit_rate": point.hit_rate,
               **point_metrics(point.outputs, point.duration_s, slo_ttft_ms), "server": point.server}
    summary["sustained"] = sustains(summary, slo_ttft_ms)
    return summary


def configuration_summary(run: ConfigurationRun, slo_ttft_ms: float, args) -> dict:
    poisson = {str(h): [point_summary(p, slo_ttft_ms) for p in run.points if p.kind == "poisson" and p.hit_rate == h]
               for h in args.hit_rates}
    closed = next(point_summary(p, slo_ttft_ms) for p in run.points if p.kind == "closed_loop")
    return {
        "server_args": run.configuration.server_args,
        "idle_ttft_ms": {"median": 1e3 * statistics.median(run.idle_ttft_s),
                         "samples": [1e3 * t for t in run.idle_ttft_s]},
        "poisson": poisson, "closed_loop": {"clients": args.clients, **closed},
        "max_sustained_rate": {h: max_sustained_rate(points, slo_ttft_ms) for h, points in poisson.items()},
        "server_metrics": run.server_metrics, "response_stats": run.response_stats,
    }


# ------------------------------------------------------------------------------------------ the command


def floats(text: str) -> list[float]:
    return sorted(float(x) for x in text.split(",") if x.strip())


def json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help=f"a smoke run's defaults: {QUICK}")
    add_load_arguments(parser, rates="1,2,4,6,8,12")
    add("--hit-rates", default="1.0,0.5", help="fractions of requests whose documents are all stored")
    add("--clients", type=int, default=16, help="clients of the closed loop")
    add("--idle-requests", type=int, default=5, help="single requests of the idle TTFT measurement")
    add("--slo-factor", type=float, default=3.0, help="TTFT SLO = this x plain's idle TTFT median")
    add("--out", type=Path, default=vllm_server.REPO / "docs" / "benchmarks" / "serving_load")
    return parser


def add_load_arguments(parser: argparse.ArgumentParser, rates: str) -> None:
    """The arguments every load benchmark shares (this one and benchmarks/mixed_load.py): model, servers,
    the RAG workload, the Poisson points."""
    add = parser.add_argument
    add("--model-size", choices=sorted(vllm_server.MODELS), default="bench",
        help="bench: benchmarks/vllm_ttft.py's 12-layer model (default); tiny: the test model")
    add("--configs", default=",".join(CONFIGURATIONS), help="which of them, comma-separated; plain is required "
        "(the others are measured against it)")
    add("--rates", default=rates, help="Poisson arrival rates, requests/s")
    add("--duration", type=float, default=60.0, help="measured seconds per load point")
    add("--warmup", type=float, default=5.0, help="seconds of load before each point's measured window")
    add("--drain", type=float, default=30.0, help="seconds after a point's last arrival before stragglers are "
        "cancelled (counted as errors)")
    add("--num-docs", type=int, default=12, help="documents in the stored pool")
    add("--docs-per-prompt", type=int, default=3)
    add("--output-len", type=int, default=8, help="generated tokens per request (ignore_eos)")
    add("--cachefuse-config", type=json_object, default={},
        help=f"connector config merged over {DEFAULT_CACHEFUSE} and a temporary store_dir")
    add("--kv-cache-bytes", type=int, default=None, help=f"vLLM's KV cache (default by model size: {KV_CACHE_BYTES})")
    add("--max-num-seqs", type=int, default=64)
    add("--allocator", choices=sorted(vllm_server.ALLOCATORS), default="tcmalloc",
        help="the servers' malloc, the same for all (default tcmalloc, as vLLM's CPU guide deploys it)")
    add("--seed", type=int, default=0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parse_load_arguments(parser, argv, QUICK)
    args.hit_rates = floats(args.hit_rates)
    if any(not 0 <= h <= 1 for h in args.hit_rates):
        parser.error("--hit-rates must be within 0..1")
    return args


def parse_load_arguments(parser: argparse.ArgumentParser, argv: list[str] | None, quick: dict) -> argparse.Namespace:
    """Parses and checks add_load_arguments' arguments; with --quick, `quick` replaces the defaults (flags
    given on the command line still win)."""
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
    args.rates = floats(args.rates)
    named = set(args.configs.split(","))
    if named - set(CONFIGURATIONS):
        parser.error(f"--configs: unknown {sorted(named - set(CONFIGURATIONS))}, expected some of {CONFIGURATIONS}")
    args.configs = [name for name in CONFIGURATIONS if name in named]  # plain first: the others need its figures
    if "plain" not in args.configs:
        parser.error("--configs must include plain: the others are measured against it")
    if not args.rates or any(r <= 0 for r in args.rates):
        parser.error("--rates must be > 0")
    if args.kv_cache_bytes is None:
        args.kv_cache_bytes = KV_CACHE_BYTES[args.model_size]
    return args


def model_and_workload(args) -> tuple[Path, rag_load.RagWorkload]:
    """The run's checkpoint and RAG workload (and its allocator library, set on args: a missing one fails
    here, before any server starts)."""
    args.allocator_library = vllm_server.allocator_library(args.allocator)
    workload = rag_load.RagWorkload(vllm_server.MODELS[args.model_size][1], args.num_docs, args.docs_per_prompt,
                                    seed=args.seed)
    return vllm_server.bench_model(args.model_size), workload


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model_dir, workload = model_and_workload(args)
    args.max_model_len = max(2048, workload.max_prompt_tokens() + args.output_len)
    store_dir = Path(tempfile.mkdtemp(prefix="cachefuse-serving-load-store-"))
    chosen = configurations(args, store_dir)
    runs = {}
    try:
        with tqdm(total=len(chosen) * (2 + len(args.rates) * len(args.hit_rates)), desc="serving load") as progress:
            for configuration in chosen:
                runs[configuration.name] = run_configuration(configuration, model_dir, workload, args, progress)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    plain_idle_ms = 1e3 * statistics.median(runs["plain"].idle_ttft_s)
    slo_ttft_ms = args.slo_factor * plain_idle_ms
    summaries = {name: configuration_summary(run, slo_ttft_ms, args) for name, run in runs.items()}
    result = {
        "benchmark": "serving_load", "command": shlex.join([sys.executable, *sys.argv]),
        "machine": vllm_server.machine(), "model_size": args.model_size, "model": model_dir.name,
        "kv_cache_bytes": args.kv_cache_bytes, "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len, "allocator": args.allocator,
        "duration_s": args.duration, "warmup_s": args.warmup, "drain_s": args.drain,
        "workload": {"num_docs": args.num_docs, "docs_per_prompt": args.docs_per_prompt,
                     "doc_lengths": list(workload.doc_lengths), "system_tokens": rag_load.SYSTEM_TOKENS,
                     "question_tokens": rag_load.QUESTION_TOKENS, "output_len": args.output_len,
                     "rates": args.rates, "hit_rates": args.hit_rates, "clients": args.clients,
                     "idle_requests": args.idle_requests, "seed": args.seed},
        "slo": {"factor": args.slo_factor, "plain_idle_ttft_ms": plain_idle_ms, "ttft_ms": slo_ttft_ms},
        "configurations": summaries,
        "ratios": {f"{name}_over_plain": ratios_over_plain(summaries, name) for name in summaries if name != "plain"},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving_load.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "serving_load.png")
    print_summary(result)


if __name__ == "__main__":
    main()

"""Soak: vLLM's OpenAI server with cachefuse under concurrent load, faults and hostile clients, beside
plain vLLM under the same load.

Each phase starts one server on 127.0.0.1 (loopback only; nothing else is contacted) with a KV cache
small enough that vLLM preempts, then runs `--clients` threads for `--duration` seconds (and at most
`--max-requests` requests). Both phases keep vLLM's prefix caching on (its default; `--prefix-caching
off` turns it off in both). Every client loops over a mix of requests:

    hit         system + 3 of 12 stored documents in a new order + a question, streamed (TTFT measured)
    miss        the same with one never-seen document (a hole: computed, saved), streamed
    plain       no cachefuse parameters, streamed
    exact       one of 16 fixed prompts at recompute ratio 1.0, not streamed: its tokens must equal plain
                vLLM's for the same prompt (taken from the plain phase)
    exact_after_blend
                one of the 16 fixed prompts blended at the default ratio (inexact by design; the blend
                writes its blocks), then the same prompt without cachefuse parameters: that answer must
                equal plain vLLM's. With prefix caching on it would not if vLLM's cache served the
                blended blocks to a plain request
    hostile     malformed kv_transfer_params (wrong types, 100 KB strings, deep nesting, null): must be a
                200 with plain output and a fallback reason
    abort       streamed, the client hangs up after the first token

Reported per phase: requests and errors by kind (an error is anything but the expected answer; the
client's own hang-ups are not), wrong exact outputs (by kind), TTFT p50/p99 of the streamed kinds,
requests/s, the server's RSS after warm-up and at the end, the store's bytes against its cap, fallbacks
by reason and preemptions, and every cachefuse counter at the phase's end (`server_metrics`: blend
seconds, steps and batch sizes, tokens recomputed; from /metrics). Threads are pinned alike in both phases
(VLLM_CPU_OMP_THREADS_BIND).

    python benchmarks/soak.py [--duration 600] [--clients 64] [--model-size bench|tiny] [--prefix-caching on|off]
        [--allocator tcmalloc|glibc|jemalloc] [--ratio-mode fixed|controller] [--selector NAME] [--out docs/benchmarks]

The server runs under tcmalloc by default (LD_PRELOAD, as vLLM's CPU guide deploys it; Debian: libtcmalloc-minimal4).

Writes soak.json and soak.png under --out.
"""

from __future__ import annotations

import argparse
import http.client
import json
import platform
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_server  # noqa: E402
from vllm_server import ALLOCATORS, REPO, allocator_library, kv_transfer_config, request, scrape, stop_server  # noqa: E402

KINDS = {"hit": 0.4, "miss": 0.1, "plain": 0.1, "exact": 0.1, "exact_after_blend": 0.1, "hostile": 0.1, "abort": 0.1}
EXACT_KINDS = ("exact", "exact_after_blend")
MAX_TOKENS = 8
KV_CACHE_BYTES = {  # small enough that 64 clients preempt
    "tiny": 4 << 20,  # 4 layers x 128: 2,048 tokens of KV cache
    "bench": 192 << 20,  # benchmarks/vllm_ttft.py's model: 8,192 tokens of KV cache
}
MODELS = {  # size -> (model config, document lengths, KV cache bytes)
    size: (config, doc_lengths, KV_CACHE_BYTES[size]) for size, (config, doc_lengths) in vllm_server.MODELS.items()}
DISK_CAP_BYTES = 64 << 20
RATIO_MODE = "fixed"
"""The connector's ratio_mode unless --ratio-mode says otherwise: fixed (not the default, the loading
controller), as in the committed runs, whose phases compare a fixed 15% blend with plain vLLM; the result
says which mode ran."""
SURROGATE = {"cachefuse": {"chunk_texts": ["\ud800"]}}
"""vLLM's HTTP front end answers a lone surrogate with a 500 before the connector sees the request (it
cannot serialize it to the engine process); the engine keeps serving. Counted apart, not as an error."""
HOSTILE = [{"cachefuse": None}, {"cachefuse": {"chunks": []}}, {"cachefuse": {"chunks": "0-5"}},
           {"cachefuse": {"chunks": [[0, 2]], "selector": "x" * 100_000}},
           {"cachefuse": {"chunks": [[0, 4]], "recompute_ratio": "0.5"}},
           {"cachefuse": {"chunks": [[5, 2]]}}, SURROGATE,
           {"cachefuse": {"chunks": [[0, 4]], "selector": [[[[[[[[[[[[[[[[[[[[["deep"]]]]]]]]]]]]]]]]]]]]]}},
           {"cachefuse": {"chunks": [[i, i + 2] for i in range(0, 600, 2)]}}]


class Workload:
    """The prompts: 12 stored documents, 16 fixed prompts whose plain answers are the reference."""

    def __init__(self, doc_lengths: tuple[int, int], seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.doc_lengths = doc_lengths
        self.system = self._ids(24)
        self.docs = [self._ids(self.rng.randint(*doc_lengths)) for _ in range(12)]
        self.exact = [self.prompt(self.rng.sample(range(12), 3), self._ids(10)) for _ in range(16)]

    def _ids(self, n: int, rng: random.Random | None = None) -> list[int]:
        return [(rng or self.rng).randrange(3, 1000) for _ in range(n)]

    def max_prompt_tokens(self) -> int:
        """The longest prompt: system, 3 documents, a miss's extra document, a question."""
        return len(self.system) + 3 * self.doc_lengths[1] + self.doc_lengths[0] + 10

    def prompt(self, doc_ids: list[int], question: list[int], extra: list[int] | None = None):
        """(token ids, chunk offsets): [system][docs...][extra?][question]."""
        ids, chunks = list(self.system), [[0, len(self.system)]]
        for doc in [self.docs[i] for i in doc_ids] + ([extra] if extra else []):
            chunks.append([len(ids), len(ids) + len(doc)])
            ids += doc
        return ids + question, chunks


def max_model_len(workload: Workload) -> int:
    """The longest prompt and its output, rounded up to a power of two, at least 512: 2,048 on the bench
    model, 512 on the tiny one, whose 4 MiB KV cache cannot hold one request of 2,048 tokens (vLLM then
    refuses to start)."""
    return max(512, 1 << (workload.max_prompt_tokens() + MAX_TOKENS - 1).bit_length())


def server_args(store: Path | None, max_len: int, prefix_caching: bool, ratio_mode: str = RATIO_MODE,
                selector: str | None = None) -> list[str]:
    """The api_server arguments of a phase: cachefuse's connector when it has a store (its `selector`, None:
    the connector's default); prefix caching left to vLLM's default (on) unless it is off."""
    args = ["--max-model-len", str(max_len), "--max-num-seqs", "64"]
    if not prefix_caching:
        args.append("--no-enable-prefix-caching")
    if store is not None:
        extra = {"store_dir": str(store), "disk_capacity_bytes": DISK_CAP_BYTES, "memory_capacity_bytes": 8 << 20,
                 "ratio_mode": ratio_mode, **({} if selector is None else {"selector": selector})}
        args += ["--kv-transfer-config", kv_transfer_config(extra)]
    return args


def streamed(port: int, body: dict, hang_up: bool) -> tuple[int, float | None]:
    """(status, seconds to the first token) of a streamed completion; `hang_up` closes after it."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    start = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            response.read()
            return response.status, None
        ttft = None
        for line in response:
            if line.startswith(b"data: ") and b'"text"' in line and ttft is None:
                ttft = time.perf_counter() - start
                if hang_up:
                    return 200, ttft
        return 200, ttft
    finally:
        conn.close()


class Phase:
    """One server under load: the client threads and what they measured."""

    def __init__(self, port: int, workload: Workload, fused: bool, reference: dict[int, str]) -> None:
        self.port, self.workload, self.fused, self.reference = port, workload, fused, reference
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.ttft: list[float] = []
        self.wrong_exact: Counter[str] = Counter()
        self.exact_outputs: dict[int, str] = {}

    def body(self, ids: list[int], params: dict | None) -> dict:
        body = {"model": "tiny", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
        if params is not None and self.fused:
            body["kv_transfer_params"] = params
        return body

    def one(self, rng: random.Random) -> None:
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        w = self.workload
        ok = True
        if kind in ("hit", "miss", "plain", "abort"):
            extra = w._ids(w.doc_lengths[0], rng) if kind == "miss" else None
            ids, chunks = w.prompt(rng.sample(range(12), 3), w._ids(10, rng), extra)
            params = None if kind == "plain" else {"cachefuse": {"chunks": chunks}}
            status, ttft = streamed(self.port, self.body(ids, params), hang_up=kind == "abort")
            ok = status == 200 and ttft is not None
            if ok and kind != "abort":
                with self.lock:
                    self.ttft.append(ttft)
        elif kind in EXACT_KINDS:
            ok = self.exact(kind, rng)
        else:
            params = rng.choice(HOSTILE)
            status, raw = request(self.port, "POST", "/v1/completions", self.body(w.exact[0][0], params))
            if status != 200 and params is SURROGATE and self.fused:
                with self.lock:
                    self.counts["hostile_rejected_by_vllm_front_end"] += 1
                return
            ok = status == 200
            if ok and self.fused:
                stats = (json.loads(raw).get("kv_transfer_params") or {}).get("cachefuse") or {}
                ok = stats.get("status") == "fallback"
        with self.lock:
            self.counts[kind] += 1
            if not ok:
                self.errors[kind] += 1

    def exact(self, kind: str, rng: random.Random) -> bool:
        """One of the fixed prompts, fused at ratio 1.0 (`exact`) or plain after a blend of the same prompt
        at the default ratio (`exact_after_blend`); its answer checked against plain vLLM's. False if the
        server refused a request."""
        index = rng.randrange(len(self.workload.exact))
        ids, chunks = self.workload.exact[index]
        params: dict | None = {"cachefuse": {"chunks": chunks, "recompute_ratio": 1.0}}
        if kind == "exact_after_blend":
            status, _ = request(self.port, "POST", "/v1/completions", self.body(ids, {"cachefuse": {"chunks": chunks}}))
            if status != 200:
                return False
            params = None
        status, raw = request(self.port, "POST", "/v1/completions", self.body(ids, params))
        if status != 200:
            return False
        text = json.loads(raw)["choices"][0]["text"]  # greedy: equal text, equal answer
        with self.lock:
            self.exact_outputs.setdefault(index, text)
            if index in self.reference and self.reference[index] != text:
                self.wrong_exact[kind] += 1
        return True

    def run(self, clients: int, duration: float, max_requests: int) -> float:
        deadline = time.monotonic() + duration
        issued = iter(range(max_requests))

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < deadline and next(issued, None) is not None:
                try:
                    self.one(rng)
                except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
                    with self.lock:
                        self.errors[f"client:{type(exc).__name__}"] += 1
        start = time.monotonic()
        threads = [threading.Thread(target=client, args=(seed,), daemon=True) for seed in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=duration + 600)
        return time.monotonic() - start


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and its children (Linux /proc)."""
    total = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        ppid = re.search(r"^PPid:\s+(\d+)", text, re.M)
        this = int(status.parent.name)
        if this == pid or (ppid and int(ppid.group(1)) == pid):
            rss = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
            total += int(rss.group(1)) * 1024 if rss else 0
    return total


def run_phase(name: str, model_dir: Path, workload: Workload, args, reference: dict) -> tuple[dict, Phase]:
    root = Path(tempfile.mkdtemp(prefix=f"cachefuse-soak-{name}-"))
    store = root / "store" if name == "cachefuse" else None
    process, port = vllm_server.start_server(
        model_dir, root / "server.log", args.kv_cache_bytes,
        server_args(store, max_model_len(workload), args.prefix_caching == "on", args.ratio_mode, args.selector),
        args.allocator_library)
    try:
        phase = Phase(port, workload, name == "cachefuse", reference)
        # the 12 documents stored once, as `cachefuse precompute` would; plain vLLM gets the same requests
        # (without cachefuse parameters), so both phases start with the same prefix cache
        for i in range(12):
            ids, chunks = workload.prompt([i], [5])
            request(port, "POST", "/v1/completions", phase.body(ids, {"cachefuse": {
                "chunks": chunks, "selector": "full_prefill"}}))
        samples: list[tuple[float, int]] = []
        sampler_stop = threading.Event()

        def sample_rss() -> None:
            start = time.monotonic()
            while not sampler_stop.wait(5.0):
                samples.append((time.monotonic() - start, rss_bytes(process.pid)))

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        elapsed = phase.run(args.clients, args.duration, args.max_requests)
        sampler_stop.set()
        sampler.join()
        metrics = scrape(port)
        # every counter of the phase (blend seconds, steps, batch sizes, tokens recomputed, loads by tier): what
        # a throughput gap between selectors is read from
        counters = vllm_server.server_counters(port)
        alive = process.poll() is None and request(port, "GET", "/health", None)[0] == 200
    finally:
        stop_server(process)
    warm = [rss for t, rss in samples if t >= 0.2 * elapsed] or [rss for _, rss in samples] or [0]
    ttft = sorted(phase.ttft)
    done = sum(phase.counts.values())
    result = {
        "requests": dict(phase.counts), "errors": dict(phase.errors),
        "wrong_exact_outputs": sum(phase.wrong_exact.values()), "wrong_exact_by_kind": dict(phase.wrong_exact),
        "exact_checked": sum(phase.counts[kind] for kind in EXACT_KINDS) if reference else 0,
        "exact_checked_by_kind": {kind: phase.counts[kind] for kind in EXACT_KINDS} if reference else {},
        "server_alive_at_end": alive,
        "elapsed_s": elapsed, "requests_per_s": done / elapsed if elapsed else 0.0,
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
        "rss_after_warmup_bytes": warm[0], "rss_end_bytes": warm[-1],
        "rss_growth": (warm[-1] - warm[0]) / warm[0] if warm[0] else None,
        "rss_samples": samples, "ttft_samples_s": ttft, **metrics, "server_metrics": counters,
    }
    if store is not None:
        result["store_bytes"] = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
        result["store_cap_bytes"] = DISK_CAP_BYTES
    return result, phase


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, phase in result["phases"].items():
        ttft = phase["ttft_samples_s"]
        if ttft:
            left.plot([1e3 * t for t in ttft], [(i + 1) / len(ttft) for i in range(len(ttft))],
                      label=f"{name}: p50 {1e3 * phase['ttft_p50_s']:.0f} ms")
        right.plot([t for t, _ in phase["rss_samples"]], [rss / 2**20 for _, rss in phase["rss_samples"]],
                   label=name)
    left.set_xlabel("time to first token (ms)")
    left.set_ylabel("fraction of streamed requests")
    left.set_xscale("log")
    left.legend(fontsize=8)
    right.set_xlabel("seconds into the phase")
    right.set_ylabel("server RSS (MiB)")
    right.legend(fontsize=8)
    fig.suptitle(f"Soak: {result['clients']} clients, {result['duration_s']:.0f} s per phase, model "
                 f"{result['model_size']}, {result.get('allocator', 'glibc')} malloc, KV cache {result['kv_cache_bytes'] >> 20} MiB "
                 f"(preempting), prefix caching {result.get('prefix_caching', 'off')}, 2 CPU threads",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load per phase")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-requests", type=int, default=200_000, help="a bound on requests per phase")
    parser.add_argument("--model-size", choices=sorted(MODELS), default="bench",
                        help="bench: benchmarks/vllm_ttft.py's 12-layer model (default); tiny: the test model")
    parser.add_argument("--allocator", choices=sorted(ALLOCATORS), default="tcmalloc",
                        help="the server's malloc, the same for both phases (default tcmalloc, as vLLM's CPU "
                             "guide deploys it)")
    parser.add_argument("--prefix-caching", choices=("on", "off"), default="on",
                        help="vLLM's prefix caching in both phases (default on, vLLM's default)")
    parser.add_argument("--ratio-mode", choices=("fixed", "controller"), default=RATIO_MODE,
                        help="the connector's ratio_mode (default fixed, as the committed runs; controller: the "
                             "connector's default)")
    parser.add_argument("--selector", default=None,
                        help="the connector's selector (default: its own default, CacheFuseConfig's)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks",
                        help="the directory soak.json and soak.png go to")
    return parser


def main(argv: list[str] | None = None) -> None:
    from cachefuse.config import CacheFuseConfig  # the selector a phase runs when none is given

    args = build_parser().parse_args(argv)
    args.allocator_library = allocator_library(args.allocator)
    _, doc_lengths, args.kv_cache_bytes = MODELS[args.model_size]
    model_dir = vllm_server.bench_model(args.model_size)
    workload = Workload(doc_lengths)
    plain, plain_phase = run_phase("plain", model_dir, workload, args, reference={})
    reference = plain_phase.exact_outputs  # plain vLLM's answers to the fixed prompts
    fused, _ = run_phase("cachefuse", model_dir, workload, args, reference=reference)
    result = {"benchmark": "soak", "clients": args.clients, "duration_s": args.duration, "threads": 2,
              "machine": platform.machine(), "model_size": args.model_size, "model": str(model_dir.name),
              "kv_cache_bytes": args.kv_cache_bytes, "allocator": args.allocator,
              "prefix_caching": args.prefix_caching, "max_model_len": max_model_len(workload), "mix": KINDS,
              "ratio_mode": args.ratio_mode, "selector": args.selector or CacheFuseConfig().selector,
              "phases": {"plain": plain, "cachefuse": fused},
              "ratios": {"ttft_p50_plain_over_cachefuse": (plain["ttft_p50_s"] or 0) / (fused["ttft_p50_s"] or 1),
                         "requests_per_s_cachefuse_over_plain":
                             fused["requests_per_s"] / plain["requests_per_s"] if plain["requests_per_s"] else None}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "soak.png")
    for name, phase in result["phases"].items():
        print(f"{name}: {sum(phase['requests'].values())} requests, errors {phase['errors']}, wrong exact "
              f"{phase['wrong_exact_outputs']}/{phase['exact_checked']} {phase['wrong_exact_by_kind']}, TTFT p50 {phase['ttft_p50_s']}, "
              f"p99 {phase['ttft_p99_s']}, {phase['requests_per_s']:.2f} req/s, RSS growth {phase['rss_growth']}, "
              f"fallbacks {phase['fallbacks_by_reason']}, preemptions {phase['preemptions']}")
    print("ratios", result["ratios"])


if __name__ == "__main__":
    main()

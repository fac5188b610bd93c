"""Fused prefill vs full prefill on a GPU: a random-weight model of Llama-3-8B's shape in bf16.

Prompt: a 32-token system prompt, 16 chunks of 512 tokens and a 64-token question (8,288 tokens).
Chunks are precomputed after the system prompt (offline, not timed) into one of two tiers:
`host` (page-locked host memory: each layer's K/V crosses PCIe during the pass, pipelined
`--preload-depth` layers ahead on a side stream) or `device` (the GPU-memory tier for hot chunks).

Measured, each the median of `--repeats` runs after `--warmup`, the settings taking turns (round r runs
each once, so a shared machine's drift falls on all alike), with a device synchronisation on both sides
of every run (TTFT as a caller sees it, host overheads included):
- `hf_forward`: the model's own transformers forward (SDPA), logits of the last position only;
- `full_prefill`: the blend pass computing every row (the engine's own path, no reuse);
- per tier, `cacheblend` at each `--ratios` (full layers 0 and 1, HKVD's selection after layer 1, then
  its rows), `full_reuse` (0%, no full layer), and the query-aware selectors at 15% (`fusionrag`, `qcfuse`; their probe's share of TTFT).

The compute bound of a setting is 1 / (rows computed over all layers / (layers x tokens)), the speed-up
if time were proportional to computed rows (loading free). `speedup_vs_hf` is median hf_forward / median
fused; `speedup_vs_hf_paired` the median over rounds of that round's ratio.

    python benchmarks/gpu_ttft.py                                  # H200: ~1 min, writes docs/benchmarks/gpu/
    python benchmarks/gpu_ttft.py --shape small --device cpu --repeats 1 --out /tmp/gpu_smoke   # a smoke run

Writes gpu_ttft.json and gpu_ttft.png under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cachefuse.adapters.hf import HFAdapter  # noqa: E402
from cachefuse.chunks import KeyContext  # noqa: E402
from cachefuse.config import CacheFuseConfig  # noqa: E402
from cachefuse.fusion.engine import FusionEngine  # noqa: E402
from cachefuse.offline.anchors import anchor_annotator  # noqa: E402
from cachefuse.store.base import StoreIdentity  # noqa: E402
from cachefuse.store.memory import MemoryStore  # noqa: E402

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0),
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=4096, rope_theta=10000.0),
}
SYSTEM_LEN = 32
QUERY_AWARE = ("fusionrag", "qcfuse")


def build_model(shape: str, dtype: torch.dtype, device: str):
    """Random weights (std 0.02, norms 1) of the named shape, built directly on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=32768, tie_word_embeddings=False,
                         initializer_range=0.02, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def interleaved(calls: dict, device: str, warmup: int, repeats: int) -> tuple[dict, dict]:
    """Seconds of each call per round, the calls taking turns (round r runs every call once), with a
    device sync on both sides of each; and each call's last return value.

    Taking turns spreads the drift of a shared machine over every setting alike: the launch-bound
    settings follow the host CPU's speed, which moved by 2x between machines and minutes here."""
    last = {}
    for name, fn in calls.items():
        for _ in range(warmup):
            last[name] = fn()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            sync(device)
            start = time.perf_counter()
            last[name] = fn()
            sync(device)
            samples[name].append(time.perf_counter() - start)
    return samples, last


def make_engine(adapter: HFAdapter, tier: str, device: str) -> FusionEngine:
    identity = StoreIdentity("gpu-bench", adapter.shape.num_layers, adapter.shape.dtype)
    cuda = device.startswith("cuda")
    store = MemoryStore(identity, capacity_bytes=64 << 30, device=device if tier == "device" else "cpu",
                        pin_memory=cuda and tier == "host")
    kv_dtype = str(adapter.shape.dtype).removeprefix("torch.")
    return FusionEngine(adapter, store, KeyContext("gpu-bench", kv_dtype), CacheFuseConfig())


def compute_bound(layer_rows: list[int], num_tokens: int) -> float:
    return len(layer_rows) * num_tokens / sum(layer_rows)


def run(args) -> dict:
    dtype = getattr(torch, args.dtype)
    model = build_model(args.shape, dtype, args.device)
    adapter = HFAdapter(model, compile=args.compile)
    vocab = adapter.shape.vocab_size
    g = torch.Generator().manual_seed(1)
    system = torch.randint(10, vocab, (SYSTEM_LEN,), generator=g).tolist()
    chunks = [torch.randint(10, vocab, (args.chunk_tokens,), generator=g).tolist() for _ in range(args.chunks)]
    question = torch.randint(10, vocab, (args.question_tokens,), generator=g).tolist()
    token_ids = system + [t for c in chunks for t in c] + question
    spans, start = [(0, SYSTEM_LEN)], SYSTEM_LEN
    for chunk in chunks:
        spans.append((start, start + len(chunk)))
        start += len(chunk)
    num_tokens = len(token_ids)
    ids = torch.tensor([token_ids], device=args.device)

    calls = {"hf_forward": lambda: model(ids, logits_to_keep=1).logits}
    engines, precompute_s, labels = {}, {}, {}
    with torch.inference_mode():
        for tier in args.tiers:
            engine = engines[tier] = make_engine(adapter, tier, args.device)
            started = time.perf_counter()
            engine.precompute([system])
            annotate = None
            if args.anchor_ranking:  # QCFuse's anchors stored offline, as a deployment would
                annotate = anchor_annotator(adapter, system, args.anchor_ranking, engine.config.qcfuse_anchor_ratio,
                                            engine.config.qcfuse_sink_tokens)
            engine.precompute(chunks, prefix_ids=system, annotate=annotate)
            precompute_s[tier] = time.perf_counter() - started
            settings = [("full_prefill", 1.0)] if tier == args.tiers[0] else []
            settings += [("cacheblend", r) for r in args.ratios] + [("full_reuse", 0.0)]
            settings += [(name, 0.15) for name in QUERY_AWARE]
            for selector, ratio in settings:
                name = "full_prefill" if selector == "full_prefill" else f"{tier}/{selector}@{ratio:g}"
                labels[name] = (tier, selector)
                # Only the stats are kept: a FuseResult holds every layer's K/V (~1 GiB here), and the
                # last of each setting would otherwise stay alive through every round.
                calls[name] = (lambda selector=selector, ratio=ratio, engine=engine: engine.prefill(
                    token_ids, spans, selector=selector, ratio=ratio, save_holes=False,
                    preload_depth=args.preload_depth)[1])
        samples, last = interleaved(calls, args.device, args.warmup, args.repeats)

    baseline = statistics.median(samples["hf_forward"])
    results = {"settings": {"hf_forward": {"seconds": baseline, "samples": samples["hf_forward"]}}}
    print(f"hf_forward {baseline * 1e3:.1f} ms", flush=True)
    for name, (tier, selector) in labels.items():
        stats = last[name]
        med = statistics.median(samples[name])
        paired = statistics.median(h / t for h, t in zip(samples["hf_forward"], samples[name], strict=True))
        entry = {
            "seconds": med, "samples": samples[name], "speedup_vs_hf": baseline / med,
            "speedup_vs_hf_paired": paired,
            "compute_bound": compute_bound(stats.layer_rows, num_tokens),
            "chunks_hit": stats.chunks_hit, "bytes_loaded": stats.bytes_loaded,
            "probe_seconds": stats.probe_time_s, "probe_share": stats.probe_time_s / med,
            "pass_layer_seconds_sum": sum(stats.layer_seconds),
        }
        if selector != "full_prefill":
            entry["precompute_seconds"] = precompute_s[tier]
        results["settings"][name] = entry
        probe = f", probe {entry['probe_share']:.0%} of TTFT" if stats.probe_time_s else ""
        print(f"{name}: {med * 1e3:.1f} ms, {entry['speedup_vs_hf']:.2f}x, paired {paired:.2f}x "
              f"(bound {entry['compute_bound']:.2f}x){probe}", flush=True)
    if args.profile:  # after every timed run: runs timed after a profile ran 10-30% slower
        profile(engines[args.tiers[-1]], token_ids, spans, args)
    engines.clear()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    results.update({
        "prompt": {"system_tokens": SYSTEM_LEN, "chunks": args.chunks, "chunk_tokens": args.chunk_tokens,
                   "question_tokens": args.question_tokens, "num_tokens": num_tokens},
        "model": {"shape": args.shape, **SHAPES[args.shape], "dtype": args.dtype, "weights": "random"},
        "repeats": args.repeats, "warmup": args.warmup, "interleaved": True, "preload_depth": args.preload_depth,
        "anchor_ranking": args.anchor_ranking, "compile": args.compile,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
        "torch": torch.__version__,
        "peak_device_memory_gib": (torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda")
                                   else None),
    })
    return results


def profile(engine: FusionEngine, token_ids, spans, args) -> None:
    """torch.profiler over a few runs of `--profile SELECTOR@RATIO`: where a fused pass spends its time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    selector, ratio = args.profile.split("@")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(3):
            engine.prefill(token_ids, spans, selector=selector, ratio=float(ratio), save_holes=False,
                           preload_depth=args.preload_depth)
    sort = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=40)
    table += "\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_ttft_profile.txt").write_text(table)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for tier in ("host", "device"):
        points = sorted((float(k.split("@")[1]), v) for k, v in results["settings"].items()
                        if k.startswith(f"{tier}/cacheblend@"))
        if points:
            ax.plot([100 * r for r, _ in points], [v["speedup_vs_hf"] for _, v in points], "o-",
                    label=f"cacheblend, {tier} tier")
            ax.plot([100 * r for r, _ in points], [v["compute_bound"] for _, v in points], ":",
                    label=f"compute bound ({tier})")
    ax.set_xlabel("recompute ratio (%)")
    ax.set_ylabel("TTFT speed-up vs the model's own forward")
    ax.set_title(f"{results['model']['shape']} ({results['model']['dtype']}, random weights), "
                 f"{results['prompt']['num_tokens']} tokens, {results['device']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.05, 0.15, 0.30])
    parser.add_argument("--tiers", nargs="+", choices=("host", "device"), default=["host", "device"])
    parser.add_argument("--preload-depth", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true",
                        help="HFAdapter(compile=True): the per-layer elementwise work through torch.compile")
    parser.add_argument("--anchor-ranking", choices=("key_norm", "attention"), default=None,
                        help="store QCFuse's anchors with each chunk (default: none, derived per request)")
    parser.add_argument("--profile", metavar="SELECTOR@RATIO",
                        help="also profile this setting on the last tier, after every timed run")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "gpu")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device: run this on a GPU machine, or pass --device cpu --shape small for a smoke run")
    results = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_ttft.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "gpu_ttft.png")
    print(f"wrote {args.out / 'gpu_ttft.json'}")


if __name__ == "__main__":
    main()

"""Fused prefill vs full prefill on the reference engine (CPU), with the compute bound.

Model: 12 layers, hidden 512, intermediate 1536, 8 heads of 64, 4 KV heads (GQA 2:1), vocab 1024,
random weights, float32. Prompt: a 64-token system prompt, 8 chunks of 256 tokens and a 32-token
question (2144 tokens). Chunks are precomputed after the system prompt into the host-memory tier
(precompute is offline and not timed). Every configuration runs in this one process with the same
thread count; each time is the median of --repeats runs after one warm-up; logits at the last
position only.

Machines here are noisy (+-10% between runs), so each fused measurement is paired with a full
prefill run right before it: the reported speed-up is the median of the per-pair ratios, beside
the ratio of the medians.

    python benchmarks/fusor_prefill.py [--threads 2] [--repeats 5] [--out docs/benchmarks]
    python benchmarks/fusor_prefill.py --model .cache/models/smollm2-135m-instruct --out /tmp/smollm2

`--model` runs the same prompt shape (random ids below the model's vocabulary) on a local
checkpoint instead, e.g. the SmolLM2 one `make model` builds; give it its own `--out`.

Writes fusor_prefill.json and fusor_prefill.png under --out.
"""

from __future__ import annotations

import argparse
import json
import os
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
from cachefuse.store.base import StoreIdentity  # noqa: E402
from cachefuse.store.memory import MemoryStore  # noqa: E402
from cachefuse.testing.tiny_models import cached_tiny_model  # noqa: E402

MODEL = dict(num_layers=12, hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=4,
             head_dim=64, vocab_size=1024, max_position_embeddings=8192)
SYSTEM_LEN, NUM_CHUNKS, CHUNK_LEN, QUESTION_LEN = 64, 8, 256, 32
RATIOS = (0.05, 0.15, 0.30)
SELECTORS = ("cacheblend", "epic")


def median_time(fn, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def paired_times(baseline, candidate, repeats: int) -> tuple[list[float], list[float]]:
    """Alternates baseline and candidate runs (after one warm-up of each) so drift hits both."""
    baseline()
    candidate()
    base_times, cand_times = [], []
    for _ in range(repeats):
        for fn, times in ((baseline, base_times), (candidate, cand_times)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return base_times, cand_times


def build_prompt(vocab_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, vocab_size, (SYSTEM_LEN,), generator=g).tolist()
    chunks = [torch.randint(3, vocab_size, (CHUNK_LEN,), generator=g).tolist() for _ in range(NUM_CHUNKS)]
    question = torch.randint(3, vocab_size, (QUESTION_LEN,), generator=g).tolist()
    token_ids = system + [t for c in chunks for t in c] + question
    spans = [(0, SYSTEM_LEN)] + [(SYSTEM_LEN + i * CHUNK_LEN, SYSTEM_LEN + (i + 1) * CHUNK_LEN)
                                 for i in range(NUM_CHUNKS)]
    return token_ids, spans, system, chunks


def compute_bound(num_full_layers: int, num_layers: int, recomputed_rows: int, num_tokens: int) -> float:
    """1 / (f + r (1 - f)): f = full layers / L, r = every recomputed row / all rows."""
    f = num_full_layers / num_layers
    r = recomputed_rows / num_tokens
    return 1.0 / (f + r * (1.0 - f))


def bench_model(model: Path | None, model_cache: Path) -> tuple[Path, dict]:
    """The checkpoint to measure, `model` or the random 12-layer one (built in `model_cache`), and
    its shape as the result files record it."""
    if model is None:
        return cached_tiny_model("llama", model_cache, **MODEL), MODEL
    config = json.loads((model / "config.json").read_text())
    keys = dict(num_layers="num_hidden_layers", hidden_size="hidden_size", intermediate_size="intermediate_size",
                num_heads="num_attention_heads", num_kv_heads="num_key_value_heads", vocab_size="vocab_size")
    shape = {ours: config[theirs] for ours, theirs in keys.items()}
    shape["head_dim"] = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return model, dict(dir=str(model), **shape)


def run(threads: int, repeats: int, out_dir: Path, model_cache: Path, model: Path | None = None) -> dict:
    torch.set_num_threads(threads)
    model_dir, model_shape = bench_model(model, model_cache)
    adapter = HFAdapter.from_pretrained(str(model_dir))
    num_layers = adapter.shape.num_layers
    store = MemoryStore(StoreIdentity("bench", num_layers, adapter.shape.dtype), capacity_bytes=8 << 30)
    engine = FusionEngine(adapter, store, KeyContext("bench", "float32"), CacheFuseConfig())
    token_ids, spans, system, chunks = build_prompt(adapter.shape.vocab_size)
    engine.precompute([system])
    engine.precompute(chunks, prefix_ids=system)
    num_tokens = len(token_ids)

    def fused(selector: str, ratio: float):
        return lambda: engine.prefill(token_ids, spans, selector=selector, ratio=ratio, save_holes=False)

    full_s, full_all = median_time(fused("full_prefill", 1.0), repeats)
    ids = torch.tensor([token_ids])

    def hf_forward():
        with torch.inference_mode():
            adapter.model(ids, logits_to_keep=1)

    hf_s, _ = median_time(hf_forward, repeats)
    rows = []
    for selector in SELECTORS:
        for ratio in RATIOS:
            full_times, fused_times = paired_times(fused("full_prefill", 1.0), fused(selector, ratio), repeats)
            median_s = statistics.median(fused_times)
            speedup = statistics.median(f / c for f, c in zip(full_times, fused_times, strict=True))
            _, stats = engine.prefill(token_ids, spans, selector=selector, ratio=ratio, save_holes=False)
            num_full = engine.fusor_full_layers(selector)
            bound = compute_bound(num_full, num_layers, stats.tokens_recomputed, num_tokens)
            rows.append(dict(selector=selector, ratio=ratio, median_s=median_s, times_s=fused_times,
                             paired_full_prefill_s=full_times, speedup_vs_full_prefill=speedup,
                             ratio_of_medians=statistics.median(full_times) / median_s,
                             speedup_vs_hf_forward=hf_s / median_s,
                             compute_bound=bound, fraction_of_bound=speedup / bound,
                             num_full_layers=num_full, recomputed_rows=stats.tokens_recomputed,
                             selected_rows=stats.num_selected, forced_rows=stats.num_forced,
                             bytes_loaded=stats.bytes_loaded))
            print(f"{selector:10s} r={ratio:4.2f}  {median_s * 1e3:7.1f} ms  {speedup:4.2f}x "
                  f"(bound {bound:4.2f}x, {speedup / bound:4.0%})", flush=True)
    result = dict(
        benchmark="fusor_prefill", threads=threads, torch_threads=torch.get_num_threads(), repeats=repeats,
        machine=dict(cpu_count=os.cpu_count(), platform=platform.platform(), torch=torch.__version__),
        model=model_shape, prompt=dict(system=SYSTEM_LEN, chunks=NUM_CHUNKS, chunk_len=CHUNK_LEN,
                                       question=QUESTION_LEN, num_tokens=num_tokens),
        full_prefill=dict(median_s=full_s, times_s=full_all), hf_forward=dict(median_s=hf_s), fused=rows)
    print(f"full prefill (same engine) {full_s * 1e3:.1f} ms; transformers forward {hf_s * 1e3:.1f} ms; "
          f"threads={threads}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fusor_prefill.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out_dir / "fusor_prefill.png")
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for index, selector in enumerate(SELECTORS):
        rows = [r for r in result["fused"] if r["selector"] == selector]
        ratios = [100 * r["ratio"] for r in rows]
        color = f"C{index}"
        ax.plot(ratios, [r["speedup_vs_full_prefill"] for r in rows], "o-", color=color,
                label=f"{selector} measured (median of paired ratios)")
        ax.plot(ratios, [r["compute_bound"] for r in rows], "--", color=color, alpha=0.6,
                label=f"{selector} compute bound")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("recompute ratio (%)")
    ax.set_ylabel("speed-up over full prefill (same engine)")
    ax.set_title(f"Fused prefill, 2144 tokens, {result['model']['num_layers']}-layer model, "
                 f"{result['threads']} threads (CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--model-cache", type=Path, default=REPO / ".cache" / "bench-models")
    parser.add_argument("--model", type=Path, default=None,
                        help="a local checkpoint instead of the random 12-layer model (give it its own --out)")
    parser.add_argument("--replot", action="store_true", help="redraw the plot from the JSON in --out")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads((args.out / "fusor_prefill.json").read_text()), args.out / "fusor_prefill.png")
        return
    run(args.threads, args.repeats, args.out, args.model_cache, args.model)


if __name__ == "__main__":
    main()

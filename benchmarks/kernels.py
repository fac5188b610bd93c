"""Triton kernels on a GPU: sparse-query attention (TFLOP/s) and gather_rotate (GB/s), against torch.

sparse_attention: csrc_triton.sparse_attention.rows_attention, and slot_rows_attention reading the
same keys from a paged cache in vLLM's FlashAttention layout (16-token pages in a shuffled block
table, as the blend pass reads them inside vLLM), against (a) torch SDPA with one dense
boolean [R, N] mask (the twin's approach in a single call), (b) the twin itself
(cachefuse.attention.rows_attention: SDPA over blocks of 64 rows, keys truncated per block) and
(c) FlexAttention (torch.compile'd, a block mask built from the same positions; skipped where it
does not import or compile). Llama-3-8B head geometry (32 query heads, 8 KV heads, head_dim 128),
bf16, context N in {8192, 32768}, R = 5 / 15 / 30% of N rows at random sorted positions. FLOPs are
the causal-visible work, sum over rows of 4 * D * Hq * (position + 1), for every method alike (a
dense-mask method does more arithmetic than it is credited with). Masks and block masks are built
outside the timed region (both are reusable across the layers of one request).

gather_rotate: cachefuse.ops.gather_rotate (RoPE-free keys rotated into rows of a merged K buffer)
against `dst[dst_rows] = src` (an unrotated index copy) and `dst[:M].copy_(src)` (a contiguous copy
of the same bytes, the memory-bandwidth roofline), and the torch twin. Bytes = src read + dst
written + int64 rows and positions. Runs only when cachefuse.ops has gather_rotate.

Timing: CUDA events around each call, --warmup calls first, the median of --reps. Versions and the
device name are recorded in the JSON.

    python benchmarks/kernels.py [--out docs/benchmarks/gpu/kernels.json] [--reps 20] [--warmup 5]
    TRITON_INTERPRET=1 python benchmarks/kernels.py --device cpu --smoke   # tiny, interpreted

Writes the JSON to --out and a PNG beside it. `--smoke` shrinks every size (for checking the script,
not for numbers) and writes under the system's temp folder unless --out is given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cachefuse import attention, ops, rope  # noqa: E402
from cachefuse.rope import RopeSpec  # noqa: E402

DEFAULT_OUT = REPO / "docs" / "benchmarks" / "gpu" / "kernels.json"
FULL = dict(contexts=(8192, 32768), ratios=(0.05, 0.15, 0.30), num_heads=32, num_kv_heads=8, head_dim=128,
            gather_rows=(0.5, 1.0))
SMOKE = dict(contexts=(97,), ratios=(0.15,), num_heads=4, num_kv_heads=2, head_dim=64, gather_rows=(0.5,))


def time_ms(fn, device: str, warmup: int, reps: int) -> float:
    """Median milliseconds of `fn()` over `reps` calls after `warmup` calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - begin))
    return statistics.median(times)


def attention_case(num_tokens: int, ratio: float, sizes: dict, device: str, seed: int = 0):
    """q [R, Hq, D] at R random sorted positions, k, v [N, Hkv, D], bf16."""
    g = torch.Generator().manual_seed(seed)
    num_rows = max(1, round(ratio * num_tokens))
    positions = torch.randperm(num_tokens, generator=g)[:num_rows].sort().values.to(device)  # int64 [R]
    d, hq, hkv = sizes["head_dim"], sizes["num_heads"], sizes["num_kv_heads"]
    q = torch.randn(num_rows, hq, d, generator=g).to(device, torch.bfloat16)
    k = torch.randn(num_tokens, hkv, d, generator=g).to(device, torch.bfloat16)
    v = torch.randn(num_tokens, hkv, d, generator=g).to(device, torch.bfloat16)
    return q, positions, k, v, d**-0.5


def dense_mask_sdpa(q, positions, k, v, scale):
    """One SDPA call over every key with a [R, N] boolean mask built beforehand."""
    mask = torch.arange(k.shape[0], device=k.device)[None, :] <= positions[:, None]  # [R, N]
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, L, D]
    return lambda: F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask[None, None], scale=scale,
                                                  enable_gqa=True)


def flex(q, positions, k, v, scale, compile_it: bool):
    """FlexAttention with a block mask from the same positions; raises where it is unavailable."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def causal_rows(b, h, q_idx, kv_idx):
        return kv_idx <= positions[q_idx]

    block_mask = create_block_mask(causal_rows, None, None, q.shape[0], k.shape[0], device=str(q.device))
    fn = torch.compile(flex_attention, dynamic=False) if compile_it else flex_attention
    q4, k4, v4 = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))  # [1, H, L, D]
    return lambda: fn(q4, k4, v4, block_mask=block_mask, scale=scale, enable_gqa=True)


def paged_copy(k, v, page_size: int = 16, seed: int = 0):
    """k, v [N, Hkv, D] in a FlashAttention-layout cache at shuffled pages -> (k_cache, v_cache, key_slots)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    num_pages = -(-num_tokens // page_size)
    physical = torch.zeros(num_pages, page_size, num_kv_heads, 2 * head_dim, dtype=k.dtype, device=k.device)
    k_cache, v_cache = physical.permute(0, 2, 1, 3).transpose(1, 2).split(head_dim, dim=-1)
    pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).to(k.device)
    positions = torch.arange(num_tokens, device=k.device)
    key_slots = pages[positions // page_size] * page_size + positions % page_size
    k_cache[key_slots // page_size, key_slots % page_size] = k
    v_cache[key_slots // page_size, key_slots % page_size] = v
    return k_cache, v_cache, key_slots


def attention_methods(q, positions, k, v, scale, device: str) -> tuple[dict, str | None]:
    """{name: zero-argument call} for one case, and why FlexAttention was skipped (None if it runs)."""
    from csrc_triton import sparse_attention as tri_attn

    k_cache, v_cache, key_slots = paged_copy(k, v)
    methods = {
        "triton": lambda: tri_attn.rows_attention(q, positions, k, v, scale),
        "triton_paged": lambda: tri_attn.slot_rows_attention(q, positions, k_cache, v_cache, key_slots, scale),
        "sdpa_dense_mask": dense_mask_sdpa(q, positions, k, v, scale),
        "twin": lambda: attention.rows_attention(q, positions, k, v, scale),
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # uncompiled flex (the CPU smoke run) warns it is slow
            methods["flex"] = flex(q, positions, k, v, scale, compile_it=device == "cuda")
            methods["flex"]()  # compiles here, outside the timing
    except Exception as exc:  # noqa: BLE001 - an optional baseline: record why, go on
        methods.pop("flex", None)
        return methods, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
    return methods, None


def bench_attention_case(args, sizes: dict, num_tokens: int, ratio: float) -> dict:
    q, positions, k, v, scale = attention_case(num_tokens, ratio, sizes, args.device)
    flops = 4 * sizes["head_dim"] * sizes["num_heads"] * int((positions + 1).sum())
    methods, flex_skipped = attention_methods(q, positions, k, v, scale, args.device)
    twin = methods["twin"]().float()
    err = (methods["triton"]().float() - twin).abs().max().item()
    err_paged = (methods["triton_paged"]().float() - twin).abs().max().item()
    row = dict(num_tokens=num_tokens, ratio=ratio, num_rows=q.shape[0], flops=flops,
               max_abs_diff_triton_vs_twin=err, max_abs_diff_triton_paged_vs_twin=err_paged, results={})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, fn in methods.items():
            ms = time_ms(fn, args.device, args.warmup, args.reps)
            row["results"][name] = dict(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
    if flex_skipped:
        row["results"]["flex"] = dict(skipped=flex_skipped)
    print(f"sparse_attention N={num_tokens} R={q.shape[0]}: " + ", ".join(
        f"{n} {r['tflops']:.1f} TFLOP/s" for n, r in row["results"].items() if "tflops" in r), flush=True)
    return row


def bench_sparse_attention(args, sizes: dict) -> list[dict]:
    return [bench_attention_case(args, sizes, n, ratio) for n in sizes["contexts"] for ratio in sizes["ratios"]]


def rope_spec(head_dim: int, device: str) -> RopeSpec:
    """Llama's geometry as tests/csrc_triton/test_rope.py builds it: NeoX layout, base 10000."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return RopeSpec(head_dim, head_dim, True, inv_freq, 1.0).to(device)


def bench_gather_rotate(args, sizes: dict | None = None) -> list[dict] | dict:
    """GB/s of ops.gather_rotate against plain copies of the same bytes; skipped without the op."""
    if not hasattr(ops, "gather_rotate"):
        return dict(skipped="cachefuse.ops has no gather_rotate")
    sizes = sizes or (SMOKE if args.smoke else FULL)
    try:
        return [bench_gather_case(args, sizes, n, round(fraction * n))
                for n in sizes["contexts"] for fraction in sizes["gather_rows"]]
    except Exception as exc:  # noqa: BLE001 - another module's op: record the failure, keep the attention figures
        return dict(skipped=f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}")


def bench_gather_case(args, sizes: dict, num_tokens: int, num_rows: int) -> dict:
    g = torch.Generator().manual_seed(1)
    spec = rope_spec(sizes["head_dim"], args.device)
    shape = (sizes["num_kv_heads"], sizes["head_dim"])
    src = torch.randn(num_rows, *shape, generator=g).to(args.device, torch.bfloat16)  # [M, Hkv, D]
    dst = torch.zeros(num_tokens, *shape, device=args.device, dtype=torch.bfloat16)  # [N, Hkv, D]
    dst_rows = torch.randperm(num_tokens, generator=g)[:num_rows].sort().values.to(args.device)  # int64 [M]
    dst_positions = dst_rows + 17  # a chunk placed 17 tokens later than it was cached
    nbytes = 2 * src.numel() * src.element_size() + 2 * 8 * num_rows
    methods = {
        "gather_rotate": lambda: ops.gather_rotate(src, dst, dst_rows, dst_positions, spec),
        "index_copy": lambda: dst.__setitem__(dst_rows, src),
        "contiguous_copy": lambda: dst[:num_rows].copy_(src),
        "twin": lambda: rope.gather_rotate(src, dst, dst_rows, dst_positions, spec),
    }
    row = dict(num_tokens=num_tokens, num_rows=num_rows, bytes=nbytes, results={})
    for name, fn in methods.items():
        ms = time_ms(fn, args.device, args.warmup, args.reps)
        row["results"][name] = dict(ms=ms, gbps=nbytes / (ms * 1e-3) / 1e9)
    print(f"gather_rotate N={num_tokens} M={num_rows}: " + ", ".join(
        f"{n} {r['gbps']:.0f} GB/s" for n, r in row["results"].items()), flush=True)
    return row


def environment(args) -> dict:
    import triton

    info = dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu (TRITON_INTERPRET=1)",
                smoke=args.smoke, warmup=args.warmup, reps=args.reps)
    return info


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    _bars(left, result["sparse_attention"], "tflops",
          lambda r: f"N={r['num_tokens'] // 1024 or r['num_tokens']}{'K' if r['num_tokens'] >= 1024 else ''}"
                    f"\n{100 * r['ratio']:.0f}%")
    left.set_ylabel("TFLOP/s (causal-visible work)")
    left.set_title(f"sparse-query attention, {result['dtype']}, Hq={result['geometry']['num_heads']} "
                   f"Hkv={result['geometry']['num_kv_heads']} D={result['geometry']['head_dim']}", fontsize=9)
    gather = result["gather_rotate"]
    if isinstance(gather, list) and gather:
        _bars(right, gather, "gbps", lambda r: f"N={r['num_tokens']}\nM={r['num_rows']}")
        right.set_ylabel("GB/s (bytes read + written)")
        right.set_title("gather_rotate into a merged K buffer", fontsize=9)
    else:
        right.text(0.5, 0.5, "gather_rotate: " + str(gather.get("skipped", "no data")), ha="center", va="center")
        right.set_axis_off()
    fig.suptitle(f"{result['environment']['device']}; torch {result['environment']['torch']}, "
                 f"triton {result['environment']['triton']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _bars(ax, rows: list[dict], metric: str, label) -> None:
    names = list(dict.fromkeys(n for r in rows for n, v in r["results"].items() if metric in v))
    width = 0.8 / max(len(names), 1)
    for index, name in enumerate(names):
        values = [r["results"].get(name, {}).get(metric, 0.0) for r in rows]
        ax.bar([i + index * width for i in range(len(rows))], values, width, label=name, color=f"C{index}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [label(r) for r in rows], fontsize=8)
    ax.legend(fontsize=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script (with --device cpu)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help=f"JSON path (default {DEFAULT_OUT.relative_to(REPO)})")
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON at --out")
    args = parser.parse_args()
    out = args.out or (Path(tempfile.gettempdir()) / "kernels_smoke.json" if args.smoke else DEFAULT_OUT)
    if args.replot:
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("kernels.py: no CUDA device here; these are GPU benchmarks. For a tiny interpreted check of the "
                 "script run `TRITON_INTERPRET=1 python benchmarks/kernels.py --device cpu --smoke`.")
    if args.device == "cpu" and not (args.smoke and os.environ.get("TRITON_INTERPRET") == "1"):
        sys.exit("kernels.py: --device cpu runs only as `--smoke` under TRITON_INTERPRET=1 (set before start).")
    if args.smoke:
        args.warmup, args.reps = min(args.warmup, 1), min(args.reps, 2)
    sizes = SMOKE if args.smoke else FULL
    result = dict(benchmark="kernels", script="benchmarks/kernels.py", environment=environment(args),
                  dtype="bfloat16", geometry={k: sizes[k] for k in ("num_heads", "num_kv_heads", "head_dim")})
    result["sparse_attention"] = bench_sparse_attention(args, sizes)
    result["gather_rotate"] = bench_gather_rotate(args, sizes)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()

"""Costs the variant metadata adds, and what the Redis tier reads at, on this machine (CPU).

Three measurements, each the median of `--repeats` timed calls after one warm-up:

1. Scheduler planning: `metadata.index.plan_variants` for a prompt of a system chunk and 8 retrieved
   chunks, over an index of 100 chunks x 5 variants (each after 3 other chunks, with statistics and a
   512-token ranking). This runs inside vLLM's `schedule()`.
1b. Planning at scale: a prompt of a system chunk and 64 retrieved chunks over an index of 10,000
   variants (1,000 chunks x 10), with prefixes capped at `max_variant_prefix_chunks` (16, the default)
   and, for comparison, uncapped (every variant recorded after 63 chunks, planned against up to 63);
   and the capped planning time for 8..128 chunks, which must grow linearly with the chunk count.
2. Worker metadata writes, SQLite file in a temporary directory under --tmp: `record_uses` of 8
   variants (one transaction: a request's reuses) and `put` of a new variant (a saved hole).
3. K/V reads of one 12.6 MB entry (512 tokens x 12 layers x 4 KV heads x 64, fp32): the Redis tier on
   a loopback redis-server started here (whole entry, one layer) and the disk tier (whole entry, served
   from the OS page cache), in bytes/s. The loading controller measures tiers the same way.

Thread counts do not matter here (no model runs); `--threads` pins torch alike for the checksums.

    python benchmarks/metadata.py [--repeats 20] [--out docs/benchmarks] [--tmp .cache]

Writes metadata.json and metadata.png under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from cachefuse.metadata.base import VariantRecord  # noqa: E402
from cachefuse.metadata.index import VariantIndex, plan_variants  # noqa: E402
from cachefuse.metadata.sqlite import SqliteMetaStore  # noqa: E402
from cachefuse.store.base import ChunkKV, StoreIdentity  # noqa: E402
from cachefuse.store.disk import DiskStore  # noqa: E402
from cachefuse.store.redis import RedisKVStore  # noqa: E402
from tests.helpers.redis_server import RedisServer  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls, after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def variant_records(rng: random.Random, num_chunks: int = 100, per_chunk: int = 5) -> list[VariantRecord]:
    keys = [f"k{i:03d}" for i in range(num_chunks)]
    records = []
    for key in keys:
        for _ in range(per_chunk):
            prefix = tuple(rng.sample([k for k in keys if k != key], 3))
            records.append(VariantRecord(chunk_key=key, prefix=prefix, inter={p: rng.random() for p in prefix},
                                         intra=1.0, num_tokens=512, prefix_num_tokens=dict.fromkeys(prefix, 512),
                                         ranked_tokens=tuple(rng.sample(range(512), 512))))
    return records


def scale_index(rng: random.Random, prefix_len: int, num_chunks: int = 1000, per_chunk: int = 10
                ) -> tuple[VariantIndex, list[str]]:
    """10,000 variants, each recorded after `prefix_len` other chunks (no token ranking: it costs planning
    nothing but memory)."""
    keys = [f"c{i:04d}" for i in range(num_chunks)]
    index = VariantIndex()
    for key in keys:
        for _ in range(per_chunk):
            prefix = tuple(k for k in rng.sample(keys, prefix_len + 1) if k != key)[:prefix_len]
            index.add(VariantRecord(chunk_key=key, prefix=prefix, inter={p: rng.random() for p in prefix},
                                    intra=1.0, num_tokens=256, prefix_num_tokens=dict.fromkeys(prefix, 256)))
    index.add(VariantRecord.without_stats("sys", (), 64))
    return index, keys


def measure_planning_scale(repeats: int) -> dict:
    rng = random.Random(1)
    out: dict = {}
    for label, prefix_len, cap in (("capped", 16, 16), ("uncapped", 63, None)):
        index, keys = scale_index(rng, prefix_len)
        chosen = ["sys", *rng.sample(keys, 64)]
        out[f"plan_64_chunks_10k_variants_{label}_s"] = timed(
            lambda index=index, chosen=chosen, cap=cap: plan_variants(
                index, chosen, [True] + [False] * 64, [64] + [256] * 64, 1.0, max_prefix_chunks=cap), repeats)
        if label == "capped":
            out["plan_capped_s_by_chunks"] = {
                n: timed(lambda n=n, index=index, keys=keys, cap=cap: plan_variants(
                    index, ["sys", *keys[:n]], [True] + [False] * n, [64] + [256] * n, 1.0,
                    max_prefix_chunks=cap), repeats) for n in (8, 16, 32, 64, 128)}
    return out


def measure(repeats: int, tmp: Path) -> dict:
    rng = random.Random(0)
    records = variant_records(rng)
    index = VariantIndex(records)
    index.add(VariantRecord.without_stats("sys", (), 64))
    chosen = ["sys", *rng.sample(sorted({r.chunk_key for r in records}), 8)]
    out = {"plan_variants_s": timed(lambda: plan_variants(index, chosen, [True] + [False] * 8, [64] + [512] * 8,
                                                           1.0), repeats)}
    out.update(measure_planning_scale(max(3, repeats // 4)))

    with tempfile.TemporaryDirectory(dir=tmp) as root:
        store = SqliteMetaStore(str(Path(root) / "meta.sqlite"), max_variants=100_000)
        for record in records:
            store.put(record)
        out["sqlite_record_uses_8_s"] = timed(
            lambda: store.record_uses([(r.variant_id, 0.3) for r in rng.sample(records, 8)]), repeats)
        fresh = iter(range(10**9))

        def put_new() -> None:
            base = rng.choice(records)
            extra = f"new{next(fresh)}"
            store.put(VariantRecord(chunk_key=base.chunk_key, prefix=(*base.prefix, extra),
                                    inter={**base.inter, extra: 0.1}, intra=1.0, num_tokens=512,
                                    prefix_num_tokens={**base.prefix_num_tokens, extra: 16}))
        out["sqlite_put_new_variant_s"] = timed(put_new, repeats)
        store.close()

        identity = StoreIdentity("bench", 12, torch.float32)
        g = torch.Generator().manual_seed(0)
        entry = ChunkKV([torch.randn(512, 4, 64, generator=g) for _ in range(12)],
                        [torch.randn(512, 4, 64, generator=g) for _ in range(12)])
        out["entry_bytes"] = entry.nbytes
        disk = DiskStore(Path(root) / "kv", identity, 1 << 32)
        disk.put("bench00", entry)
        out["disk_get_s"] = timed(lambda: disk.get("bench00"), repeats)
        with RedisServer() as server:
            redis_tier = RedisKVStore(server.url, identity, timeout_s=30.0)
            assert redis_tier.put("bench00", entry)
            out["redis_get_s"] = timed(lambda: redis_tier.get("bench00"), repeats)
            out["redis_get_layer_s"] = timed(lambda: redis_tier.get_layer("bench00", 3), repeats)
            redis_tier.close()
    out["disk_bytes_per_s"] = entry.nbytes / out["disk_get_s"]
    out["redis_bytes_per_s"] = entry.nbytes / out["redis_get_s"]
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["medians"]
    names = ["plan 8 chunks / 500 variants", "plan 64 chunks / 10k variants", "same, prefixes uncapped",
             "sqlite record_uses (8)", "sqlite put (new)", "redis get_layer", "disk get", "redis get"]
    values = [m["plan_variants_s"], m["plan_64_chunks_10k_variants_capped_s"],
              m["plan_64_chunks_10k_variants_uncapped_s"], m["sqlite_record_uses_8_s"],
              m["sqlite_put_new_variant_s"], m["redis_get_layer_s"], m["disk_get_s"], m["redis_get_s"]]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.barh(names, [1e3 * v for v in values], color=["C0", "C0", "C4", "C1", "C1", "C2", "C3", "C2"])
    for y, v in enumerate(values):
        ax.text(1e3 * v, y, f" {1e3 * v:.2f} ms", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("median time per call (ms, log scale)")
    ax.set_title(f"Variant metadata and tier reads ({m['entry_bytes'] / 1e6:.1f} MB entry), CPU", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--tmp", type=Path, default=REPO / ".cache", help="where the SQLite and disk files go")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.tmp.mkdir(parents=True, exist_ok=True)
    medians = measure(args.repeats, args.tmp)
    result = {"benchmark": "metadata", "repeats": args.repeats, "threads": args.threads,
              "machine": platform.machine(), "python": platform.python_version(), "medians": medians}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metadata.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "metadata.png")
    for name, value in medians.items():
        if isinstance(value, dict):
            shown = ", ".join(f"{n}: {v * 1e3:.2f} ms" for n, v in value.items())
        else:
            shown = f"{value / 1e9:.2f} GB/s" if name.endswith("per_s") else (
                f"{value / 1e6:.1f} MB" if name == "entry_bytes" else f"{value * 1e3:.3f} ms")
        print(f"{name:<40} {shown}")


if __name__ == "__main__":
    main()

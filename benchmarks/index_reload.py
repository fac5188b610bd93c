"""What one refresh of the scheduler's variant index costs at scale: every row read vs only the new ones.

The scheduler keeps an in-process index of the variant metadata and refreshes it on a background thread
of its own process whenever the store's generation changes (another engine's save or eviction, about
once a second under load). A full reload reads and parses every row (metadata.refresher.IndexRefresher with
full=True); an incremental one reads the variant ids and only the rows the index has not seen. The
store holds `--variants` variants (1,000 chunks, each variant after 16 other chunks, with statistics
and a 512-token ranking, as the worker saves them), in SQLite (on /dev/shm when present, so building
the store does not wait on fsync) and in Redis (a loopback redis-server started here). Each figure is
the median of `--repeats` refreshes, each after one new variant was put. No model runs: threads do not
matter.

    python benchmarks/index_reload.py [--variants 10000] [--repeats 5] [--out docs/benchmarks]

Writes index_reload.json and index_reload.png under --out.
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

from cachefuse.metadata.base import VariantRecord  # noqa: E402
from cachefuse.metadata.index import VariantIndex  # noqa: E402
from cachefuse.metadata.redis import RedisMetaStore  # noqa: E402
from cachefuse.metadata.refresher import IndexRefresher  # noqa: E402
from cachefuse.metadata.sqlite import SqliteMetaStore  # noqa: E402
from tests.helpers.redis_server import RedisServer  # noqa: E402


def make_record(rng: random.Random, chunks: list[str], i: int) -> VariantRecord:
    chunk = chunks[i % len(chunks)]
    prefix = tuple(rng.sample([k for k in chunks[:64] if k != chunk], 16))
    return VariantRecord(chunk, prefix, {k: rng.random() / 16 for k in prefix}, rng.random(), 512,
                         {k: 300 for k in prefix}, tuple(rng.sample(range(512), 512)), f_r=rng.random())


def measure(store, num_variants: int, repeats: int) -> dict:
    rng = random.Random(0)
    chunks = [f"{i:032x}" for i in range(1000)]
    start = time.perf_counter()
    for i in range(num_variants):
        store.put(make_record(rng, chunks, i))
    built_s = time.perf_counter() - start
    result = {"variants": num_variants, "build_s": built_s}
    for mode in ("full", "incremental"):
        index = VariantIndex()
        refresher = IndexRefresher(index, lambda: store, 3600, full_interval_s=float("inf"))
        refresher.refresh_once(store, full=True)
        samples, rows = [], []
        for i in range(repeats):
            store.put(make_record(rng, chunks, num_variants + len(result) * repeats + i))
            before = refresher.rows_read
            start = time.perf_counter()
            assert refresher.refresh_once(store, full=mode == "full")
            samples.append(time.perf_counter() - start)
            rows.append(refresher.rows_read - before)
        result[mode] = {"median_s": statistics.median(samples), "samples_s": samples,
                        "rows_read_per_refresh": statistics.median(rows), "index_variants": len(index)}
    result["ratio_full_over_incremental"] = result["full"]["median_s"] / result["incremental"]["median_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    args = parser.parse_args()
    results = {}
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as tmp:
        store = SqliteMetaStore(str(Path(tmp) / "meta.sqlite"), max_variants=args.variants * 2)
        results["sqlite"] = measure(store, args.variants, args.repeats)
        store.close()
    with RedisServer() as server:
        store = RedisMetaStore(server.url, max_variants=args.variants * 2, timeout_s=30.0)
        results["redis"] = measure(store, args.variants, args.repeats)
        store.close()
    for name, r in results.items():
        print(f"{name}: {r['variants']} variants: full {r['full']['median_s'] * 1e3:.0f} ms "
              f"({r['full']['rows_read_per_refresh']:.0f} rows), incremental "
              f"{r['incremental']['median_s'] * 1e3:.1f} ms ({r['incremental']['rows_read_per_refresh']:.0f} rows): "
              f"{r['ratio_full_over_incremental']:.0f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "index_reload", "machine": platform.platform(), "python": platform.python_version(),
               "repeats": args.repeats, "results": results}
    (args.out / "index_reload.json").write_text(json.dumps(payload, indent=2) + "\n")
    plot(results, args.out / "index_reload.png")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    for offset, mode in ((-width / 2, "full"), (width / 2, "incremental")):
        values = [results[n][mode]["median_s"] * 1e3 for n in names]
        bars = ax.bar([i + offset for i in range(len(names))], values, width, label=mode)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(names)), [f"{n}\n{results[n]['variants']:,} variants" for n in names])
    ax.set_yscale("log")
    ax.set_ylabel("one index refresh (ms, median)")
    ax.set_title("Scheduler index refresh after one new variant")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

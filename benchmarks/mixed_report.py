"""What benchmarks/mixed_load.py derives from its result and shows of it: per rate and class (chat, RAG)
each configuration's TTFT and ITL over plain's, whether the targets hold (chat turns' TTFT within a
tolerance of plain's, RAG requests' TTFT p50 below plain's, the chat probe's prefix cache hits equal to
plain's), the figure (one column per class, TTFT p50,
TTFT p99 and ITL p99 against the rate, one line per configuration) and the printed summary. Reads only the
result dict that mixed_load.json holds. Not a script.
"""

from __future__ import annotations

from pathlib import Path

from load_metrics import ratio
from load_report import ms, rate_panel, times

CLASSES = ("chat", "rag")
RATIO_FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
TITLES = {"chat": "chat turns (no cachefuse parameters)", "rag": "RAG requests"}
PANELS = (("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p99_ms", "TTFT p99 (ms)"), ("itl_p99_ms", "ITL p99 (ms)"))


def class_ratios(summaries: dict[str, dict], name: str) -> list[dict]:
    """Per rate and class, `name`'s TTFT and ITL p50/p99 over plain's at the same rate (None where either
    has no figure)."""
    rows = []
    for mine, plain in zip(summaries[name]["points"], summaries["plain"]["points"], strict=True):
        assert mine["rate"] == plain["rate"], (mine["rate"], plain["rate"])
        rows.append({"rate": mine["rate"], **{
            kind: {figure.removesuffix("_ms"): ratio(mine[kind][figure], plain[kind][figure])
                   for figure in RATIO_FIGURES} for kind in CLASSES}})
    return rows


def within(value: float | None, bound: float) -> bool:
    return value is not None and value <= bound


def verdicts(summaries: dict[str, dict], rows: list[dict], name: str, tolerance: float) -> list[dict]:
    """Per rate, the targets for `name` against plain (`rows`: class_ratios(summaries, name)): no errors;
    chat TTFT p50 and p99 at most 1 + tolerance times plain's; RAG TTFT p50 below plain's, its speed-up
    (plain's TTFT p50 over this one's) said."""
    verdict_rows = []
    for row, point in zip(rows, summaries[name]["points"], strict=True):
        rag_p50 = row["rag"]["ttft_p50"]
        verdict_rows.append({
            "rate": row["rate"],
            "errors": sum(point[kind]["errors"] for kind in CLASSES),
            "chat_ttft_p50_within": within(row["chat"]["ttft_p50"], 1 + tolerance),
            "chat_ttft_p99_within": within(row["chat"]["ttft_p99"], 1 + tolerance),
            "rag_ttft_p50_speedup": None if not rag_p50 else 1 / rag_p50,
            "rag_faster": rag_p50 is not None and rag_p50 < 1.0,
        })
    return verdict_rows


def probe_as_plain(summaries: dict[str, dict], name: str) -> bool:
    """Whether `name`'s chat probe found in vLLM's prefix cache exactly what plain's found, turn by turn."""
    return summaries[name]["chat_probe_cached_tokens"] == summaries["plain"]["chat_probe_cached_tokens"]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANELS), len(CLASSES), figsize=(10, 3.2 * len(PANELS)), squeeze=False)
    for column, kind in enumerate(CLASSES):
        for row, (figure, label) in enumerate(PANELS):
            ax = axes[row][column]
            rate_panel(ax, {name: [(p["rate"], p[kind][figure]) for p in summary["points"]]
                            for name, summary in result["configurations"].items()},
                       TITLES[kind], "arrival rate, both classes (requests/s, Poisson)", label)
            ax.legend(fontsize=8)
    workload = result["workload"]
    fig.suptitle(f"Chat beside RAG: model {result['model_size']}, {workload['chat_share']:g} of arrivals chat turns "
                 f"({workload['chat_sessions']} sessions of {workload['turns']} turns), RAG hit rate "
                 f"{workload['hit_rate']:g},\n{workload['output_len']} output tokens, {result['duration_s']:g} s per "
                 f"point, server threads on CPUs {result['machine']['server_threads_bound']}, {result['allocator']} "
                 "malloc", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def class_line(point: dict, kind: str) -> str:
    figures = point[kind]
    return (f"    {kind:>4}: {figures['completed']}/{figures['requests']} done, {figures['errors']} errors, "
            f"TTFT p50/p99 {ms(figures['ttft_p50_ms'])}/{ms(figures['ttft_p99_ms'])} ms, ITL p50/p99 "
            f"{ms(figures['itl_p50_ms'])}/{ms(figures['itl_p99_ms'])} ms")


def print_summary(result: dict) -> None:
    for name, summary in result["configurations"].items():
        print(f"{name}: chat probe, prompt tokens from vLLM's prefix cache per turn {summary['chat_probe_cached_tokens']}")
        for point in summary["points"]:
            print(f"  {point['rate']:g} req/s: {point['chat_turns_held']} chat turns waited for their previous "
                  f"turn (at most {point['chat_held_max_s']:.1f} s)")
            for kind in CLASSES:
                print(class_line(point, kind))
    tolerance = result["targets"]["tolerance"]
    for name, rows in result["ratios"].items():
        print(f"{name}: chat probe as plain's: {result['targets']['chat_probe_as_plain'][name]}")
        for row, verdict in zip(rows, result["targets"]["per_configuration"][name], strict=True):
            print(f"  {row['rate']:g} req/s: chat TTFT p50 {times(row['chat']['ttft_p50'])} p99 "
                  f"{times(row['chat']['ttft_p99'])} (within {1 + tolerance:.2f}x: "
                  f"{verdict['chat_ttft_p50_within']}/{verdict['chat_ttft_p99_within']}), ITL p99 "
                  f"{times(row['chat']['itl_p99'])}; RAG TTFT p50 {times(row['rag']['ttft_p50'])} p99 "
                  f"{times(row['rag']['ttft_p99'])}, ITL p99 {times(row['rag']['itl_p99'])}; errors {verdict['errors']}")

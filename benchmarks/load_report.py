"""What benchmarks/serving_load.py shows of its result: the figure (TTFT p99 and ITL p99 against the
Poisson rate, one line per configuration, one column per hit rate, the TTFT SLO marked) and the
printed summary. Reads only the result dict that serving_load.json holds. Not a script.
"""

from __future__ import annotations

from pathlib import Path

PANELS = (("ttft_p99_ms", "TTFT p99 (ms)"), ("itl_p99_ms", "ITL p99 (ms)"))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hit_rates = result["workload"]["hit_rates"]
    fig, axes = plt.subplots(len(PANELS), len(hit_rates), figsize=(5 * len(hit_rates), 7.5), squeeze=False)
    slo = result["slo"]["ttft_ms"]
    for column, hit_rate in enumerate(hit_rates):
        for row, (metric, label) in enumerate(PANELS):
            ax = axes[row][column]
            rate_panel(ax, {name: [(p["rate"], p[metric]) for p in summary["poisson"][str(hit_rate)]]
                            for name, summary in result["configurations"].items()},
                       f"hit rate {hit_rate:g}", "arrival rate (requests/s, Poisson)", label)
            if metric == "ttft_p99_ms":
                ax.axhline(slo, color="grey", linestyle="--", label=f"SLO {slo:.0f} ms")
            ax.legend(fontsize=8)
    workload = result["workload"]
    fig.suptitle(f"Serving under load: model {result['model_size']}, {workload['docs_per_prompt']} of "
                 f"{workload['num_docs']} documents per prompt, {workload['output_len']} output tokens,\n"
                 f"{result['duration_s']:g} s per point, server threads on CPUs "
                 f"{result['machine']['server_threads_bound']}, {result['allocator']} malloc", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def rate_panel(ax, lines: dict[str, list[tuple[float, float | None]]], title: str, xlabel: str, ylabel: str) -> None:
    """One panel: a line per configuration through its (rate, figure) points, those without a figure left
    out; log scale. The caller adds the legend (after anything else it draws)."""
    for name, points in lines.items():
        shown = [(rate, value) for rate, value in points if value is not None]
        ax.plot([rate for rate, _ in shown], [value for _, value in shown], marker="o", label=name)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def point_line(point: dict, where: str) -> str:
    return (f"  {where:>12}, hits {point['hit_rate']:g}: {point['completed']}/{point['requests']} done, "
            f"{point['errors']} errors, {point['requests_per_s']:.2f} req/s, {point['output_tokens_per_s']:.1f} "
            f"tok/s, TTFT p50/p99 {ms(point['ttft_p50_ms'])}/{ms(point['ttft_p99_ms'])} ms, ITL p50/p99 "
            f"{ms(point['itl_p50_ms'])}/{ms(point['itl_p99_ms'])} ms, E2EL p50/p99 {ms(point['e2el_p50_ms'])}/"
            f"{ms(point['e2el_p99_ms'])} ms, goodput {point['goodput_requests_per_s']:.2f} req/s")


def print_summary(result: dict) -> None:
    print(f"TTFT SLO {result['slo']['ttft_ms']:.1f} ms ({result['slo']['factor']:g} x plain's idle TTFT)")
    for name, summary in result["configurations"].items():
        fallbacks = {k: v for k, v in summary["server_metrics"].items() if k.startswith("requests_fallback")}
        print(f"{name}: idle TTFT {summary['idle_ttft_ms']['median']:.1f} ms, max sustained rate "
              f"{summary['max_sustained_rate']}, fallbacks {fallbacks}")
        for points in summary["poisson"].values():
            for point in points:
                print(point_line(point, f"{point['rate']:g} req/s"))
        print(point_line(summary["closed_loop"], f"{summary['closed_loop']['clients']} clients"))
    for name, ratios in result["ratios"].items():
        sustained = ", ".join(f"hits {h}: {times(v)}" for h, v in ratios["max_sustained_rate"].items())
        print(f"{name}: closed loop TTFT p50 {times(ratios['closed_loop_ttft_p50'])}, requests/s "
              f"{times(ratios['closed_loop_requests_per_s'])}; max sustained rate {sustained}")
        for hit_rate, rows in ratios["per_rate"].items():
            print(f"  hits {hit_rate}: " + ", ".join(
                f"{row['rate']:g} req/s TTFT p50 {times(row['ttft_p50'])} ITL p99 {times(row['itl_p99'])}"
                for row in rows))

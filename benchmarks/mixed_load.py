"""Chat beside RAG: multi-turn chat sessions and RAG requests in one Poisson stream against vLLM's OpenAI
server plain and with cachefuse, both with vLLM's defaults (prefix caching on). Does adding the connector
cost the chat turns (plain requests, served by vLLM's prefix cache) anything, and do the RAG requests keep
their fused speed-up beside them?

Configurations, servers, the RAG workload and its stored documents are benchmarks/serving_load.py's (plain,
plain_no_prefix_cache as a reference, cachefuse; one server each, one after another, alike but for their
flags). Chat turns (benchmarks/chat_load.py: a session's history and a new user message) carry no cachefuse
parameters on any server; RAG requests carry their chunks on cachefuse's. For each of --rates (requests/s,
both classes together; --chat-share of them chat turns, going to --chat-sessions live sessions of --turns
turns): --warmup seconds not measured, --duration seconds measured, stragglers cancelled --drain seconds
after the last arrival and counted as errors. Every configuration gets the same requests at the same
times (seeded per rate).

Per rate and class (chat, RAG), vLLM's own figures (benchmarks/load_metrics.py): completed, errors, TTFT,
ITL and end-to-end latency p50/p99, throughput; the chat turns that waited for their session's previous
turn (a sign the server fell behind; the wait is not in their TTFT); the server's counter deltas (prefix
cache hits, cachefuse's counters). After the rates, on the idle server, a chat probe: one fresh session
turn after turn, non-streamed, each response saying how many prompt tokens vLLM's prefix cache held (every
server runs with --enable-prompt-tokens-details, which only adds that to responses); server-wide counters
cannot say which class a hit went to. Ratios over plain per rate and class (TTFT and ITL p50/p99) and the
targets: chat TTFT p50 and p99 within --tolerance (10%) of plain's, RAG TTFT p50 below plain's, the chat
probe's hits turn by turn equal to plain's.

    python benchmarks/mixed_load.py [--quick] [--model-size bench|tiny] [--rates 1,2,3,4] [--duration 60]
        [--chat-share 0.5] [--chat-sessions 8] [--turns 6] [--hit-rate 1.0] [--configs plain,cachefuse]
        [--cachefuse-config '{json}'] [--allocator tcmalloc|glibc|jemalloc] [--out docs/benchmarks/mixed_load]

--quick: the tiny model, rates 2,4, 8 s points, 4 sessions of 4 turns (a smoke run of a few minutes); flags
given with it still win. Writes mixed_load.json (every figure, the command line, the machine, the servers'
arguments) and mixed_load.png under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import chat_load  # noqa: E402
import rag_load  # noqa: E402
import serving_load  # noqa: E402
import vllm_server  # noqa: E402
from load_metrics import point_metrics  # noqa: E402
from mixed_report import CLASSES, class_ratios, plot, print_summary, probe_as_plain, verdicts  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

PROMPT_TOKENS_DETAILS = "--enable-prompt-tokens-details"  # responses say how many prompt tokens vLLM's cache held
QUICK = dict(model_size="tiny", rates="2,4", duration=8.0, warmup=2.0, drain=10.0, chat_sessions=4, turns=4)


def point_summary(rate: float, arrivals: list[chat_load.Arrival], mixed: chat_load.MixedRun, warmup_s: float,
                  server: dict[str, float]) -> dict:
    """One rate's figures per class over the requests that arrived after the warm-up; the window runs from
    the warm-up's end to the run's end."""
    window_s = mixed.run.elapsed_s - warmup_s
    measured = [(arrival, sent.output, held_s)
                for arrival, sent, held_s in zip(arrivals, mixed.run.sent, mixed.held_s, strict=True)
                if sent.at_s >= warmup_s]
    summary: dict = {"rate": rate, "duration_s": window_s}
    for kind in CLASSES:
        mine = [(arrival, output) for arrival, output, _ in measured if arrival.kind == kind]
        summary[kind] = point_metrics([output for _, output in mine], window_s, slo_ttft_ms=None)
        summary[kind]["prompt_tokens_mean"] = (statistics.mean(len(a.prompt.ids) for a, _ in mine) if mine
                                               else None)
    held = [held_s for arrival, _, held_s in measured if arrival.kind == "chat" and held_s > 0]
    summary.update(chat_turns_held=len(held), chat_held_max_s=max(held, default=0.0), server=server)
    return summary


def mixed_point(port: int, targets: dict[str, rag_load.Target], chat: chat_load.ChatWorkload,
                rag: rag_load.RagWorkload, rate: float, args) -> dict:
    seed = f"{args.seed}/mixed/{rate}"  # the same requests at the same times for every configuration
    load = chat_load.MixedLoad(rate, args.chat_share, args.chat_sessions, args.hit_rate)
    arrivals = chat_load.mixed_schedule(load, args.warmup + args.duration, chat, rag, seed)
    with tqdm(total=len(arrivals), desc=f"  {rate:g} req/s", leave=False) as pbar:
        mixed, server = serving_load.run_counted(port, chat_load.mixed_open_loop(targets, arrivals, args.drain, pbar))
    return point_summary(rate, arrivals, mixed, args.warmup, server)


def cached_tokens(response: dict) -> int | None:
    """The prompt tokens vLLM's prefix cache held for a completion (its usage's prompt_tokens_details,
    present under PROMPT_TOKENS_DETAILS), or None if the response does not say."""
    details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
    return details.get("cached_tokens")


def chat_probe(port: int, chat: chat_load.ChatWorkload, output_len: int) -> list[int | None]:
    """One fresh chat session on the idle server, turn after turn: the prompt tokens vLLM's prefix cache
    held for each. A turn's hit is the previous turn's prompt up to its last full block wherever the chat
    turns keep vLLM's prefix cache; every configuration draws the same session."""
    cached = []
    for turn in chat.session(random.Random("chat-probe"), session=-1):
        status, raw = vllm_server.request(port, "POST", "/v1/completions", {
            "model": vllm_server.SERVED_MODEL_NAME, "prompt": turn.ids, "max_tokens": output_len,
            "temperature": 0.0, "ignore_eos": True})
        if status != 200:
            raise RuntimeError(f"chat probe turn {turn.turn}: {status} {raw[:300]!r}")
        cached.append(cached_tokens(json.loads(raw)))
    return cached


def run_configuration(configuration: serving_load.Configuration, model_dir: Path, chat: chat_load.ChatWorkload,
                      rag: rag_load.RagWorkload, args, progress: tqdm) -> dict:
    """Starts the configuration's server, stores the RAG documents, measures every rate, and stops it."""
    progress.set_description(f"{configuration.name}: starting")
    with serving_load.serving(configuration, model_dir, args) as (port, url):
        targets = {"chat": rag_load.Target(url, vllm_server.SERVED_MODEL_NAME, False, args.output_len),
                   "rag": rag_load.Target(url, vllm_server.SERVED_MODEL_NAME, configuration.fused, args.output_len)}
        serving_load.store_documents(port, rag, configuration.fused)
        points = []
        for rate in args.rates:
            progress.set_description(f"{configuration.name}: {rate:g} req/s")
            points.append(mixed_point(port, targets, chat, rag, rate, args))
            progress.update()
        return {"server_args": configuration.server_args, "points": points,
                "chat_probe_cached_tokens": chat_probe(port, chat, args.output_len),
                "server_metrics": vllm_server.server_counters(port)}


def server_configurations(args, store_dir: Path) -> list[serving_load.Configuration]:
    """serving_load's configurations, each server also saying in every response how many prompt tokens its
    prefix cache held (for the chat probe)."""
    return [dataclasses.replace(c, server_args=[*c.server_args, PROMPT_TOKENS_DETAILS])
            for c in serving_load.configurations(args, store_dir)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help=f"a smoke run's defaults: {QUICK}")
    serving_load.add_load_arguments(parser, rates="1,2,3,4")
    add("--chat-share", type=float, default=0.5, help="the fraction of arrivals that are chat turns")
    add("--chat-sessions", type=int, default=8, help="chat sessions live at a time")
    add("--turns", type=int, default=6, help="turns per chat session")
    add("--hit-rate", type=float, default=1.0, help="the fraction of RAG requests whose documents are all stored")
    add("--tolerance", type=float, default=0.10, help="the chat turns' TTFT target: at most 1 + this x plain's")
    add("--out", type=Path, default=vllm_server.REPO / "docs" / "benchmarks" / "mixed_load")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = serving_load.parse_load_arguments(parser, argv, QUICK)
    if not 0 < args.chat_share < 1:
        parser.error(f"--chat-share {args.chat_share}: expected strictly between 0 and 1 (both classes present)")
    if args.chat_sessions < 1 or args.turns < 1:
        parser.error(f"--chat-sessions {args.chat_sessions} and --turns {args.turns}: expected >= 1")
    if not 0 <= args.hit_rate <= 1 or args.tolerance < 0:
        parser.error(f"--hit-rate {args.hit_rate}: expected 0..1; --tolerance {args.tolerance}: expected >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model_dir, rag = serving_load.model_and_workload(args)
    chat = chat_load.ChatWorkload(chat_load.USER_LENGTHS[args.model_size], args.output_len, args.turns, args.seed)
    args.max_model_len = max(2048, max(rag.max_prompt_tokens(), chat.max_prompt_tokens()) + args.output_len)
    store_dir = Path(tempfile.mkdtemp(prefix="cachefuse-mixed-load-store-"))
    chosen = server_configurations(args, store_dir)
    summaries = {}
    try:
        with tqdm(total=len(chosen) * len(args.rates), desc="mixed load") as progress:
            for configuration in chosen:
                summaries[configuration.name] = run_configuration(configuration, model_dir, chat, rag, args, progress)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    ratios = {f"{name}_over_plain": class_ratios(summaries, name) for name in summaries if name != "plain"}
    result = {
        "benchmark": "mixed_load", "command": shlex.join([sys.executable, *sys.argv]),
        "machine": vllm_server.machine(), "model_size": args.model_size, "model": model_dir.name,
        "kv_cache_bytes": args.kv_cache_bytes, "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len, "allocator": args.allocator,
        "duration_s": args.duration, "warmup_s": args.warmup, "drain_s": args.drain,
        "workload": {"rates": args.rates, "chat_share": args.chat_share, "chat_sessions": args.chat_sessions,
                     "turns": args.turns, "chat_system_tokens": chat_load.CHAT_SYSTEM_TOKENS,
                     "user_lengths": list(chat.user_lengths), "hit_rate": args.hit_rate, "num_docs": args.num_docs,
                     "docs_per_prompt": args.docs_per_prompt, "doc_lengths": list(rag.doc_lengths),
                     "output_len": args.output_len, "seed": args.seed},
        "configurations": summaries, "ratios": ratios,
        "targets": {"tolerance": args.tolerance, "per_configuration": {
            key: verdicts(summaries, rows, key.removesuffix("_over_plain"), args.tolerance)
            for key, rows in ratios.items()}, "chat_probe_as_plain": {
            key: probe_as_plain(summaries, key.removesuffix("_over_plain")) for key in ratios}},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mixed_load.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "mixed_load.png")
    print_summary(result)


if __name__ == "__main__":
    main()

"""benchmarks/mixed_load.py and mixed_report.py: the command line, a point's figures per class, the ratios
over plain, the targets, and the report drawn from a result. No server."""

from __future__ import annotations

import json
from pathlib import Path

import mixed_load
import mixed_report
import pytest
from chat_load import Arrival, ChatTurn, MixedRun
from rag_load import RagPrompt, Run, Sent

endpoint = pytest.importorskip("vllm.benchmarks.lib.endpoint_request_func")


def answered(ttft_s: float, itl_s: float = 0.002) -> endpoint.RequestFuncOutput:
    return endpoint.RequestFuncOutput(success=True, ttft=ttft_s, itl=[itl_s] * 3, latency=ttft_s + 3 * itl_s,
                                      output_tokens=4, start_time=0.0)


def test_quick_sets_small_defaults_and_given_flags_still_win():
    args = mixed_load.parse_args(["--quick", "--turns", "3"])
    assert (args.model_size, args.rates, args.duration, args.chat_sessions, args.turns) == ("tiny", [2.0, 4.0], 8.0, 4, 3)
    full = mixed_load.parse_args([])
    assert (full.model_size, full.rates, full.chat_share, full.hit_rate, full.tolerance) == \
        ("bench", [1.0, 2.0, 3.0, 4.0], 0.5, 1.0, 0.10)
    assert full.configs == ["plain", "plain_no_prefix_cache", "cachefuse"]
    assert full.out.parts[-3:] == ("docs", "benchmarks", "mixed_load")


@pytest.mark.parametrize("argv", [["--chat-share", "0"], ["--chat-share", "1"], ["--chat-sessions", "0"],
                                  ["--turns", "0"], ["--hit-rate", "1.5"], ["--tolerance", "-0.1"],
                                  ["--configs", "cachefuse"], ["--rates", "0"]])
def test_bad_command_lines_are_refused(argv):
    with pytest.raises(SystemExit):
        mixed_load.parse_args(argv)


def test_a_point_splits_its_measured_requests_by_class():
    chat, rag = ChatTurn([1] * 50, session=0, turn=0), RagPrompt([2] * 100, [[0, 24]], hit=True)
    arrivals = [Arrival(0.5, "chat", chat), Arrival(1.0, "rag", rag), Arrival(2.0, "chat", chat, after=0),
                Arrival(3.0, "rag", rag), Arrival(4.0, "chat", chat, after=2)]
    outputs = [answered(9.0), answered(0.100), answered(0.010), answered(0.200), answered(0.030)]
    run = MixedRun(Run([Sent(a.at_s, o) for a, o in zip(arrivals, outputs, strict=True)], elapsed_s=11.0),
                   held_s=[0.0, 0.0, 0.7, 0.0, 0.0])
    point = mixed_load.point_summary(2.0, arrivals, run, warmup_s=1.0, server={"prefix_cache_hits": 64.0})
    assert point["duration_s"] == 10.0 and point["rate"] == 2.0
    assert point["chat"]["requests"] == 2 and point["rag"]["requests"] == 2  # the 9 s warm-up turn is out
    assert point["chat"]["ttft_p50_ms"] == pytest.approx(20.0)
    assert point["rag"]["ttft_p50_ms"] == pytest.approx(150.0)
    assert point["chat"]["prompt_tokens_mean"] == 50 and point["rag"]["prompt_tokens_mean"] == 100
    assert point["chat"]["goodput_requests_per_s"] is None  # no SLO here
    assert (point["chat_turns_held"], point["chat_held_max_s"]) == (1, 0.7)
    assert point["server"] == {"prefix_cache_hits": 64.0}


def class_figures(ttft_p50: float, ttft_p99: float, itl: float = 10.0, errors: int = 0) -> dict:
    return {"ttft_p50_ms": ttft_p50, "ttft_p99_ms": ttft_p99, "itl_p50_ms": itl, "itl_p99_ms": 2 * itl,
            "requests": 10, "completed": 10 - errors, "errors": errors}


def point(rate: float, chat: dict, rag: dict) -> dict:
    return {"rate": rate, "chat": chat, "rag": rag, "chat_turns_held": 0, "chat_held_max_s": 0.0, "server": {}}


def summaries() -> dict:
    plain = [point(1.0, class_figures(100.0, 200.0), class_figures(300.0, 500.0)),
             point(2.0, class_figures(100.0, 200.0), class_figures(400.0, 900.0))]
    cachefuse = [point(1.0, class_figures(110.0, 219.0), class_figures(100.0, 200.0, itl=5.0)),  # within 10%
                 point(2.0, class_figures(111.0, 200.0), class_figures(None, None, errors=10))]  # p50 just over
    return {"plain": {"points": plain, "server_args": [], "chat_probe_cached_tokens": [0, 128, 256]},
            "cachefuse": {"points": cachefuse, "server_args": [], "chat_probe_cached_tokens": [0, 128, 256]}}


def test_ratios_divide_each_class_by_plain_at_the_same_rate():
    rows = mixed_report.class_ratios(summaries(), "cachefuse")
    assert [row["rate"] for row in rows] == [1.0, 2.0]
    assert rows[0]["chat"] == {"ttft_p50": pytest.approx(1.10), "ttft_p99": pytest.approx(1.095),
                               "itl_p50": pytest.approx(1.0), "itl_p99": pytest.approx(1.0)}
    assert rows[0]["rag"]["ttft_p50"] == pytest.approx(1 / 3) and rows[0]["rag"]["itl_p99"] == pytest.approx(0.5)
    assert rows[1]["rag"]["ttft_p50"] is None  # nothing completed


def test_targets_hold_within_the_tolerance_and_fail_just_past_it():
    every = summaries()
    verdicts = mixed_report.verdicts(every, mixed_report.class_ratios(every, "cachefuse"), "cachefuse", 0.10)
    assert verdicts[0] == {"rate": 1.0, "errors": 0, "chat_ttft_p50_within": True, "chat_ttft_p99_within": True,
                           "rag_ttft_p50_speedup": pytest.approx(3.0), "rag_faster": True}
    assert verdicts[1]["chat_ttft_p50_within"] is False  # 1.11x plain's
    assert verdicts[1]["chat_ttft_p99_within"] is True
    assert (verdicts[1]["rag_ttft_p50_speedup"], verdicts[1]["rag_faster"], verdicts[1]["errors"]) == (None, False, 10)


def test_plain_against_itself_meets_the_chat_target_but_has_no_speed_up():
    every = summaries()
    verdicts = mixed_report.verdicts(every, mixed_report.class_ratios(every, "plain"), "plain", 0.0)
    assert all(v["chat_ttft_p50_within"] and v["chat_ttft_p99_within"] for v in verdicts)
    assert not any(v["rag_faster"] for v in verdicts)


def result_of(every: dict) -> dict:
    rows = mixed_report.class_ratios(every, "cachefuse")
    return {"model_size": "tiny", "duration_s": 8.0, "allocator": "tcmalloc", "machine": {"server_threads_bound": "0-1"},
            "workload": {"chat_share": 0.5, "chat_sessions": 4, "turns": 4, "hit_rate": 1.0, "output_len": 8},
            "configurations": every, "ratios": {"cachefuse_over_plain": rows},
            "targets": {"tolerance": 0.1, "per_configuration": {
                "cachefuse_over_plain": mixed_report.verdicts(every, rows, "cachefuse", 0.1)},
                "chat_probe_as_plain": {"cachefuse_over_plain": mixed_report.probe_as_plain(every, "cachefuse")}}}


def test_the_report_prints_and_draws_a_result_as_json_holds_it(tmp_path, capsys):
    result = json.loads(json.dumps(result_of(summaries())))  # what mixed_load.json gives back
    mixed_report.print_summary(result)
    printed = capsys.readouterr().out
    assert "chat TTFT p50 1.10x p99 1.09x (within 1.10x: True/True)" in printed
    assert "RAG TTFT p50 0.33x" in printed and "RAG TTFT p50 -" in printed
    assert "cachefuse_over_plain: chat probe as plain's: True" in printed
    mixed_report.plot(result, tmp_path / "mixed_load.png")
    assert (tmp_path / "mixed_load.png").stat().st_size > 10_000


def test_the_chat_probe_must_match_plain_turn_by_turn():
    every = summaries()
    assert mixed_report.probe_as_plain(every, "cachefuse")
    every["cachefuse"]["chat_probe_cached_tokens"] = [0, 128, 128]  # the last turn missed a block plain hit
    assert not mixed_report.probe_as_plain(every, "cachefuse")


def test_cached_tokens_are_read_from_the_usage_s_prompt_tokens_details():
    assert mixed_load.cached_tokens({"usage": {"prompt_tokens": 300, "prompt_tokens_details": {"cached_tokens": 256}}}) == 256
    assert mixed_load.cached_tokens({"usage": {"prompt_tokens": 300, "prompt_tokens_details": None}}) is None
    assert mixed_load.cached_tokens({"choices": []}) is None


def test_every_server_reports_its_prefix_cache_hits_per_response():
    args = mixed_load.parse_args([])
    args.max_model_len = 2048
    for configuration in mixed_load.server_configurations(args, Path("/tmp/store")):
        assert configuration.server_args[-1] == mixed_load.PROMPT_TOKENS_DETAILS

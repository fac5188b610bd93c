"""`make demo` runs end to end on the real model: the committed frontier is summarised, a survey of
questions says how often the default answers like full prefill, the question its rule picks is shown in
detail (the default answering like full prefill there, and full reuse not, when the rule says so), the
recomputed tokens are shown and the picture is written.

Needs the converted SmolLM2 checkpoint (`make model`, which `make test` runs first); skipped without it,
naming the command. About a minute on 2 CPU cores (a survey of 6 questions, one timed prefill per
configuration).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

from cachefuse.testing import smollm2

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_DIR = Path(os.environ.get("CACHEFUSE_SMOLLM2_DIR") or REPO_ROOT / smollm2.DEFAULT_DIR)


def load_demo():
    spec = importlib.util.spec_from_file_location("cachefuse_demo", REPO_ROOT / "examples" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def answer_lines(output: str) -> dict[str, str]:
    """config label -> its table row, from the printed table."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("config")) + 2
    rows = {}
    for line in lines[start:]:
        if not line.strip():
            break
        label = line[:16].strip()
        rows[label] = line[16:]
    return rows


@pytest.mark.slow
@pytest.mark.skipif(not smollm2.is_fetched(SMOLLM2_DIR),
                    reason=f"no converted SmolLM2 checkpoint in {SMOLLM2_DIR}: `make model` builds it")
def test_the_demo_answers_and_draws_what_was_recomputed(tmp_path, capsys):
    demo = load_demo()
    demo.main(["--model", str(SMOLLM2_DIR), "--out", str(tmp_path), "--repeats", "1", "--threads", "2",
               "--survey", "6"])
    output = capsys.readouterr().out
    assert "1. The quality-speed frontier" in output and "<- the defaults" in output
    survey = re.search(r"answers like full prefill on (\d+) of 6; full reuse on (\d+) of 6", output)
    assert survey, output
    rows = answer_lines(output)
    expected = {"full_prefill", "full_reuse"} | {f"{s} {r:.0%}" for s in demo.DEFAULT_SELECTORS for r in demo.RATIOS}
    assert set(rows) == expected, sorted(rows)
    answer = {label: row[:34].strip() for label, row in rows.items()}
    if "while full reuse does not)" in output:  # the rule's first case: the one fusion exists for
        assert answer["cacheblend 15%"] == answer["full_prefill"]
        assert answer["full_reuse"] != answer["full_prefill"]  # negative control: without fusion it is lost
    else:  # the survey found no such question: it says so, and the counts agree
        assert int(survey.group(1)) == 0 or int(survey.group(2)) > 0, output
    assert "(the configured default) recomputed" in output and "[" in output
    assert (tmp_path / "recomputed.png").stat().st_size > 10_000
    assert (tmp_path / "store").is_dir()


def test_the_frontier_summary_reads_the_committed_json(capsys):
    demo = load_demo()
    demo.print_frontier(demo.FRONTIER_JSON)
    output = capsys.readouterr().out
    frontier = json.loads(demo.FRONTIER_JSON.read_text())
    listed = {line[3:41].strip() for line in output.splitlines() if line.startswith("   ") and line[3:4] != " "}
    for point in frontier["points"]:  # the frontier and the defaults shown; a dominated point only counted
        shown = point["on_frontier"] or point.get("default") or point["name"] in (
            (frontier["targets"].get(key) or {}).get("name")
            for key in ("fastest_at_target_quality", "best_quality_at_target_speed"))
        assert (point["name"] in listed) == bool(shown), point["name"]
    assert ("NOT met" in output) == (not frontier["targets"]["met"])

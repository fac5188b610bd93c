"""`make demo` runs end to end on the real model: every configuration answers, full prefill answers the
demo's two-document question right and full reuse does not (the case the demo is built around), the
recomputed tokens are shown and the picture is written.

Needs the converted SmolLM2 checkpoint (`make model`, which `make test` runs first); skipped without it,
naming the command. About 30 s on 2 CPU cores (one timed prefill per configuration).
"""

from __future__ import annotations

import importlib.util
import os
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
    demo.main(["--model", str(SMOLLM2_DIR), "--out", str(tmp_path), "--repeats", "1", "--threads", "2"])
    output = capsys.readouterr().out
    rows = answer_lines(output)
    expected = {"full_prefill", "full_reuse"} | {f"{s} {r:.0%}" for s in demo.DEFAULT_SELECTORS for r in demo.RATIOS}
    assert set(rows) == expected, sorted(rows)
    assert "smoked herring" in rows["full_prefill"] and " 1.00 " in rows["full_prefill"]
    assert "smoked herring" not in rows["full_reuse"]  # negative control: without fusion the answer is lost
    assert "(the configured default) recomputed" in output and "[" in output
    assert (tmp_path / "recomputed.png").stat().st_size > 10_000
    assert (tmp_path / "store").is_dir()

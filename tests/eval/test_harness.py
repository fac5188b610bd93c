"""`cachefuse eval` on a tiny random model: invariants of the harness, the report and the CLI.

The probe model's own figures are tests/eval/test_probe_model.py's; here any model will do.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from cachefuse.cli.main import main
from cachefuse.config import CacheFuseConfig
from cachefuse.eval.harness import (
    EvalItem,
    EvalSpec,
    last_token_attention,
    reference_engine,
    run_eval,
    store_base_variants,
)
from cachefuse.eval.report import format_table, plot_report, summarize
from cachefuse.rag_prompt import build_rag_prompt

WORDS = "the river castle garden library museum engine memory network server planet ocean forest island".split()


def make_items(num_items: int, seed: int = 0) -> list[EvalItem]:
    rng = random.Random(seed)

    def sentence(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))) + "."

    return [EvalItem("You answer from the documents.\n", tuple(sentence(8, 16) for _ in range(3)),
                     " Which " + sentence(2, 4), (rng.choice(WORDS),), kind=("a", "b")[i % 2])
            for i in range(num_items)]


@pytest.fixture(scope="module")
def runs(model_dir):
    engine, tokenizer = reference_engine(model_dir, CacheFuseConfig(cachecraft_early_termination=False))
    spec = EvalSpec(selectors=("cacheblend", "epic", "cachecraft", "random"), ratios=(0.0, 0.15, 1.0),
                    metric="em", max_new_tokens=3)
    return run_eval(engine, tokenizer, make_items(6), spec, progress=False)


def test_ratio_one_equals_full_prefill_for_every_selector(runs):
    full = runs.runs["full_prefill"]
    for name in ("cacheblend", "epic", "cachecraft", "random"):
        for run, ref in zip(runs.runs[f"{name}@1"], full, strict=True):
            assert run.kl < 1e-6, name  # fp32 rounding of the recomputed rows
            assert run.greedy_match == 1.0 and run.prediction == ref.prediction
            assert max(run.kv_deviation) < 1e-5 and max(run.attention_deviation) < 1e-5
    assert all(r.kl == 0.0 and r.recompute_fraction == 1.0 for r in full)


def test_full_reuse_deviates_and_fifteen_percent_deviates_less(runs):
    """Negative control for the fidelity metrics: full reuse is not full prefill."""
    reuse = runs.runs["full_reuse"]
    assert all(r.kl > 0 for r in reuse)
    assert all(max(r.kv_deviation) > 1e-3 and max(r.attention_deviation) > 1e-4 for r in reuse)
    assert all(r.kv_deviation[0] < 1e-6 for r in reuse), "layer 0 K/V depend on the token alone"
    blend = runs.runs["cacheblend@0.15"]
    assert sum(r.kl for r in blend) < sum(r.kl for r in reuse)
    assert all(0.1 < r.recompute_fraction < 0.3 for r in blend)


def test_last_token_attention_is_the_full_prefills_own(model_dir):
    """Recomputed over the full prefill's K/V, the last row's attention equals transformers' eager
    attention weights of the whole prompt, and rows sum to 1."""
    engine, tokenizer = reference_engine(model_dir, CacheFuseConfig())
    item = make_items(1, seed=4)[0]
    prompt = build_rag_prompt(tokenizer, item.system, item.chunks, item.question)
    store_base_variants(engine, prompt)
    result, _ = engine.prefill(prompt.token_ids, prompt.chunks, selector="full_prefill", save_holes=False,
                               variants=[None] * len(prompt.chunks))
    layers = range(engine.adapter.shape.num_layers)
    attention = last_token_attention(engine, result, prompt.token_ids[-1], layers)
    model = engine.adapter.model
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = model(torch.tensor([prompt.token_ids]), output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    for layer in layers:
        torch.testing.assert_close(attention[layer], out.attentions[layer][0, :, -1].float(), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(attention[layer].sum(-1), torch.ones(engine.adapter.shape.num_heads))


def test_summary_pairs_every_setting_with_full_prefill_and_cacheblend(runs):
    summary = summarize(runs)
    assert summary["kinds"] == {"all": 6, "a": 3, "b": 3}
    assert len(summary["settings"]) == 2 + 4 * 3
    for key, setting in summary["settings"].items():
        entry = setting["by_kind"]["all"]
        assert ("vs_full_prefill" in entry) == (key != "full_prefill")
        assert ("vs_cacheblend" in entry) == (setting["selector"] in ("epic", "cachecraft", "random"))
        assert len(setting["fidelity"]["kv_deviation_per_layer"]) == len(runs.runs["full_prefill"][0].kv_deviation)
    assert summary["settings"]["cacheblend@0.15"]["check_layers"] == [1]
    assert summary["settings"]["full_reuse"]["check_layers"] == []
    table = format_table(summary)
    assert "cacheblend@0.15" in table and "full_reuse" in table


def test_plot_is_written(runs, tmp_path):
    summary = summarize(runs)
    plot_report(summary, tmp_path / "q.png", kind="a")
    assert (tmp_path / "q.png").stat().st_size > 1000


def test_cli_eval_writes_json_and_plot(model_dir, tmp_path, capsys):
    data = tmp_path / "items.jsonl"
    data.write_text("\n".join(json.dumps({"system": i.system, "chunks": list(i.chunks), "question": i.question,
                                          "answer": i.answers[0]}) for i in make_items(2)) + "\n")
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    code = main(["eval", "--model", str(model_dir), "--data", str(data), "--selectors", "cacheblend",
                 "--ratios", "0.15", "--out", str(out), "--plot", str(plot), "--no-progress"])
    assert code == 0
    report = json.loads(out.read_text())
    assert set(report["settings"]) == {"full_prefill", "full_reuse", "cacheblend@0.15"}
    assert report["max_new_tokens"] == 8 and plot.exists()
    assert "cacheblend@0.15" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--longbench", "x.jsonl"], "--longbench needs --dataset"),
    (["--probe", "4", "--dataset", "hotpotqa"], "--dataset applies to --longbench only"),
    (["--probe", "4", "--selectors", "nope"], "selector='nope'"),
    (["--probe", "4", "--ratios", "0.1,2"], "expected comma-separated numbers in 0..1"),
    (["--probe", "4", "--split", "test"], "--split applies to --qa only"),
    # output paths are checked before the run: a bad one lost the computed report to a traceback
    (["--probe", "4", "--out", "/nonexistent-cachefuse-dir/r.json"], "no directory '/nonexistent-cachefuse-dir'"),
    (["--probe", "4", "--plot", "/"], "--plot '/': a directory"),
])
def test_cli_eval_rejects_bad_arguments(model_dir, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--model", str(model_dir), *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_eval_runs_a_longbench_file_with_its_metric(model_dir, tmp_path):
    """A LongBench-format file (generated here): split at the Passage markers, scored with qa_f1."""
    context = "Passage 1:\nAlice lives in Paris.\nPassage 2:\nBob is Alice's brother.\nPassage 3:\nCarol visits Tokyo.\n"
    rows = [{"input": "Where does Alice live?", "context": context, "answers": ["Paris"], "_id": f"q{i}"}
            for i in range(2)]
    data = tmp_path / "hotpotqa.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "lb.json"
    code = main(["eval", "--model", str(model_dir), "--longbench", str(data), "--dataset", "hotpotqa",
                 "--selectors", "epic", "--ratios", "1", "--max-new-tokens", "4", "--out", str(out),
                 "--no-progress"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["metric"] == "f1" and report["num_items"] == 2 and report["kinds"]["hotpotqa"] == 2
    full = report["settings"]["full_prefill"]["by_kind"]["all"]["score"]["mean"]
    assert report["settings"]["epic@1"]["by_kind"]["all"]["score"]["mean"] == full


def test_cli_eval_runs_the_qa_set_by_kind_with_f1(model_dir, tmp_path):
    out = tmp_path / "qa.json"
    code = main(["eval", "--model", str(model_dir), "--qa", "2", "--split", "test", "--selectors", "cacheblend",
                 "--ratios", "0.15", "--max-new-tokens", "2", "--out", str(out), "--no-progress"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["metric"] == "f1" and report["kinds"] == {"all": 2, "single": 1, "multi": 1}


def test_items_are_independent_of_the_variant_budget(model_dir):
    """Each item gets a fresh store: a budget that two items' base variants would overflow cannot turn
    a later item's reuse into a partial prefill (an evicted chunk is computed in full)."""
    items = make_items(3, seed=2)
    spec = EvalSpec(selectors=(), ratios=(), max_new_tokens=1)
    tight, tight_tok = reference_engine(model_dir, CacheFuseConfig(max_variants=4))  # system + 3 chunks
    roomy, roomy_tok = reference_engine(model_dir, CacheFuseConfig())
    a = run_eval(tight, tight_tok, items, spec, progress=False).runs["full_reuse"]
    b = run_eval(roomy, roomy_tok, items, spec, progress=False).runs["full_reuse"]
    assert [r.kl for r in a] == pytest.approx([r.kl for r in b], abs=1e-9)
    assert all(r.kl > 0 for r in a)


def test_a_chunk_that_cannot_be_loaded_stops_the_evaluation(model_dir):
    """Negative control: a budget below one item's chunks means a reuse setting would silently compute
    a chunk in full; the harness refuses to report it."""
    engine, tokenizer = reference_engine(model_dir, CacheFuseConfig(max_variants=2))
    with pytest.raises(RuntimeError, match="not loaded"):
        run_eval(engine, tokenizer, make_items(1), EvalSpec(selectors=(), ratios=()), progress=False)

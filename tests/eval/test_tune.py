"""Fitting Cache-Craft's alpha (Eq. 13): the data loader, the F1 metric, tune_alpha on a tiny model, the CLI.

The rules under test are cachefuse/eval/tune.py's docstring; the CFO math is tests/metadata/test_scores.py's.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path

import pytest

from cachefuse.cli.main import main
from cachefuse.config import CacheFuseConfig
from cachefuse.errors import ConfigError
from cachefuse.eval.metrics import normalize_answer, qa_f1_score
from cachefuse.eval.tune import (
    AlphaRow,
    TuneReport,
    TuneSpec,
    ValItem,
    check_items,
    choose_alpha,
    read_items_jsonl,
    tune_alpha,
)
from tests.helpers.fusion import make_engine

WORDS = ("the river castle garden library museum engine memory network server planet ocean forest island "
         "bridge harbor station market kitchen recipe festival Alice Bob Carol Paris London Tokyo").split()


def make_items(num_items: int, seed: int = 0, answer: str | None = None) -> list[ValItem]:
    """`num_items` prompts of a system prompt, 3 English-like chunks and a question."""
    rng = random.Random(seed)

    def sentence(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(low, high))) + ".\n"

    return [ValItem("You answer from the documents.\n", tuple(sentence(10, 25) for _ in range(3)),
                    "Who " + sentence(3, 6), answer) for _ in range(num_items)]


def write_jsonl(path: Path, items: list[ValItem]) -> Path:
    lines = [json.dumps({k: v for k, v in asdict(item).items() if v is not None}) for item in items]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def warm_report(adapter, tokenizer) -> TuneReport:
    engine = make_engine(adapter, CacheFuseConfig())
    report = tune_alpha(engine, tokenizer, make_items(4), TuneSpec(alphas=(2.0, 0.0, 1.0, 0.5, 10.0), floor=1.0),
                        progress=False)
    assert engine.config == CacheFuseConfig()  # restored
    return report


# --------------------------------------------------------------------------- data and metric


@pytest.mark.parametrize("line, field", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected an object"),
    ('{"chunks": ["c"], "question": "q"}', 'field "system"'),
    ('{"system": "s", "chunks": ["c"]}', 'field "question"'),
    ('{"system": "s", "chunks": [], "question": "q"}', 'field "chunks"'),
    ('{"system": "s", "chunks": "c", "question": "q"}', 'field "chunks"'),
    ('{"system": "s", "chunks": ["c", 3], "question": "q"}', 'field "chunks"[1]'),
    ('{"system": "s", "chunks": ["c", ""], "question": "q"}', 'field "chunks"[1]'),
    ('{"system": "s", "chunks": ["c"], "question": "q", "answer": 7}', 'field "answer"'),
])
def test_reader_rejects_bad_lines_naming_line_and_field(tmp_path, line, field):
    good = '{"system": "s", "chunks": ["c"], "question": "q", "id": 1}'  # other keys are ignored
    path = tmp_path / "val.jsonl"
    path.write_text(f"{good}\n\n{line}\n", encoding="utf-8")
    with pytest.raises(ValueError) as info:
        read_items_jsonl(path)
    assert f"{path}:3: " in str(info.value) and field in str(info.value)


def test_reader_reads_items_and_f1_needs_answers(tmp_path):
    path = write_jsonl(tmp_path / "val.jsonl", [ValItem("s", ("a", "b"), "q", "ans"), ValItem("", ("c",), "")])
    items = read_items_jsonl(path)
    assert items == [ValItem("s", ("a", "b"), "q", "ans"), ValItem("", ("c",), "", None)]
    check_items(items, "match")
    with pytest.raises(ValueError, match='item 1: field "answer" is missing'):
        check_items(items, "f1")
    with pytest.raises(ValueError, match="no items"):
        read_items_jsonl(write_jsonl(tmp_path / "empty.jsonl", []))


def test_spec_validates_and_sorts_alphas():
    assert TuneSpec(alphas=(2, 0.5, 2), floor=0.9).alphas == (0.5, 2.0)
    for bad in ({"alphas": ()}, {"alphas": (101.0,)}, {"alphas": (float("nan"),)}, {"floor": 1.5},
                {"metric": "rouge"}, {"max_new_tokens": 0}):
        with pytest.raises(ConfigError):
            TuneSpec(**{"alphas": (1.0,), "floor": 0.5, **bad})


def test_f1_matches_longbench_on_hand_examples():
    assert normalize_answer("An  Apple, THE pie.") == "apple pie"
    assert qa_f1_score("The Eiffel Tower!", "eiffel tower") == 1.0
    assert qa_f1_score("in Paris, France", "Paris") == pytest.approx(0.5)  # P 1/3, R 1
    assert qa_f1_score("paris paris", "Paris") == pytest.approx(2 / 3)  # repeated tokens count once each
    assert qa_f1_score("Bob and Alice", "Alice, Carol") == pytest.approx(0.4)  # P 1/3, R 1/2
    assert qa_f1_score("a cat", "the dog") == 0.0 and qa_f1_score("", "dog") == 0.0


def test_choice_is_lowest_cfo_among_feasible_rows():
    rows = [AlphaRow(0.0, 0.0, 0.0, 0.5), AlphaRow(1.0, 0.3, 0.3, 0.95), AlphaRow(2.0, 0.3, 0.3, 0.97),
            AlphaRow(3.0, 0.6, 0.6, 1.0)]
    assert choose_alpha(rows, 0.0) == 0.0
    assert choose_alpha(rows, 0.9) == 1.0  # tie on CFO: the smaller alpha
    assert choose_alpha(rows, 1.0) == 3.0 and choose_alpha(rows[:3], 1.0) is None


# --------------------------------------------------------------------------- tune_alpha


def test_cfo_grows_with_alpha_and_alpha_star_follows_eq13(warm_report):
    rows = warm_report.rows
    assert [r.alpha for r in rows] == [0.0, 0.5, 1.0, 2.0, 10.0]
    cfos = [r.mean_cfo for r in rows]
    assert cfos == sorted(cfos) and cfos[0] == 0.0 and rows[0].recompute_fraction == 0.0
    assert 0.0 < cfos[1] and cfos[-1] <= 1.0  # warm variants: chunks with beta' = 1 keep CFO 0
    assert all(0.0 <= r.quality <= 1.0 and 0.0 <= r.recompute_fraction <= 1.0 for r in rows)
    feasible = [r for r in rows if r.quality >= 1.0]
    expected = min(feasible, key=lambda r: (r.mean_cfo, r.alpha)).alpha if feasible else None
    assert warm_report.alpha == expected and warm_report.floor == 1.0
    assert choose_alpha(rows, 0.0) == 0.0  # floor 0: everything is feasible, alpha 0 has CFO 0
    data = json.loads(json.dumps(warm_report.to_dict()))
    assert data["alpha"] == expected and data["num_items"] == 4 and len(data["rows"]) == 5
    assert data["metric"] == "match" and data["reference_quality"] == 1.0


def test_large_alpha_recomputes_everything_and_matches_full_prefill(adapter, tokenizer):
    """Base variants only: CFO = clamp(alpha * 0.5) for every retrieved chunk after the first (whose base
    variant has its exact context, CFO 0), so alpha 10 recomputes every loaded token that is not exact."""
    engine = make_engine(adapter, CacheFuseConfig())
    spec = TuneSpec(alphas=(0.0, 10.0), floor=1.0, warm_variants=False)
    report = tune_alpha(engine, tokenizer, make_items(4, seed=1), spec, progress=False)
    low, high = report.rows
    assert high.quality == 1.0 and report.alpha == 10.0 and low.quality < 1.0
    assert high.mean_cfo == pytest.approx(2 / 3)  # per item: chunk 1 CFO 0, chunks 2 and 3 CFO 1
    assert choose_alpha(report.rows, 0.0) == 0.0


# --------------------------------------------------------------------------- the CLI


def test_cli_prints_alpha_star_and_config_line(model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "val.jsonl", make_items(2, seed=2))
    argv = ["tune-alpha", "--model", str(model_dir), "--data", str(data), "--alphas", "1,0", "--no-progress"]
    assert main([*argv, "--floor", "0"]) == 0
    out = capsys.readouterr().out
    assert "alpha* = 0\n" in out and "config: cachecraft_alpha: 0" in out


def test_cli_json_and_exit_1_when_no_alpha_reaches_the_floor(model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "val.jsonl", make_items(2, seed=3, answer="xylophone"))  # never generated
    assert main(["tune-alpha", "--model", str(model_dir), "--data", str(data), "--floor", "0.5", "--metric", "f1",
                 "--alphas", "0.5", "--max-new-tokens", "4", "--no-warm", "--json", "--no-progress"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["alpha"] is None and report["metric"] == "f1" and report["rows"][0]["quality"] == 0.0
    assert report["best_alpha"] == 0.5 and not report["warm_variants"]


@pytest.mark.parametrize("extra, line, message", [
    ((), '{"system": "s", "chunks": ["c"], "question": 3}', ':2: field "question"'),
    (("--metric", "f1"), '{"system": "s", "chunks": ["c"], "question": "q"}', 'field "answer" is missing'),
    (("--alphas", "1,x"), '{"system": "s", "chunks": ["c"], "question": "q"}', "comma-separated numbers"),
    (("--floor", "2"), '{"system": "s", "chunks": ["c"], "question": "q"}', "expected a number in 0..1"),
])
def test_cli_bad_data_or_arguments_exit_2(tmp_path, capsys, extra, line, message):
    data = tmp_path / "val.jsonl"
    data.write_text('{"system": "s", "chunks": ["c"], "question": "q", "answer": "a"}\n' + line + "\n")
    argv = ["tune-alpha", "--model", str(tmp_path / "no-model"), "--data", str(data), "--floor", "0.5", *extra]
    with pytest.raises(SystemExit) as info:
        main(argv)  # fails before the (missing) model is looked at
    assert info.value.code == 2 and message in capsys.readouterr().err

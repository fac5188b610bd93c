"""LongBench-format loading: split rules per dataset, prompts, scores; files generated here."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from cachefuse.eval.longbench import SPECS, load_longbench_jsonl, mean_score, split_passages


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


CONTEXT = ("Passage 1:\nAlice lives in Paris.\nPassage 2:\nBob is Alice's brother.\n"
           "Passage 10:\nCarol visits Tokyo.\n")


def test_passages_split_at_markers_and_join_back():
    assert split_passages(CONTEXT) == ["Passage 1:\nAlice lives in Paris.\n", "Passage 2:\nBob is Alice's brother.\n",
                                       "Passage 10:\nCarol visits Tokyo.\n"]
    assert split_passages("Intro.\nPassage 1:\nx") == ["Intro.\n", "Passage 1:\nx"]
    assert split_passages("no markers") == ["no markers"]


def test_qa_dataset_builds_system_passages_question(tmp_path, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))
    path = write(tmp_path / "hotpotqa.jsonl", [
        {"_id": "q1", "input": "Where does Bob's sister live?", "context": CONTEXT, "answers": ["Paris"]},
        {"_id": "q2", "input": "Who visits Tokyo?", "context": CONTEXT, "answers": ["Carol", "Carol Smith"]}])
    items = load_longbench_jsonl(path, "hotpotqa")
    assert [i.id for i in items] == ["q1", "q2"] and len(items[0].chunks) == 3
    assert "".join(items[0].chunks) == CONTEXT
    assert items[0].system.startswith("Answer the question based on the given passages.")
    assert items[0].question.endswith("Question: Where does Bob's sister live?\nAnswer:")
    prompt = items[0].prompt(tokenizer)
    assert len(prompt.chunks) == 4  # system + 3 passages, each declared
    assert items[0].score("paris.") == 1.0 and items[1].score("Carol Smith") == 1.0
    assert mean_score(items, ["Paris", "nobody"]) == pytest.approx(50.0)
    assert load_longbench_jsonl(path, "hotpotqa", limit=1)[0].id == "q1"


def test_summaries_split_into_token_windows(tmp_path, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))
    dialogue = " ".join(f"Speaker{i % 3}: line number {i} about the river and the castle." for i in range(60))
    path = write(tmp_path / "samsum.jsonl", [{"input": "Dialogue: hi\nSummary:", "context": dialogue,
                                              "answers": ["they talk about a river"]}])
    (item,) = load_longbench_jsonl(path, "samsum", tokenizer, chunk_tokens=64)
    ids = tokenizer.encode(dialogue, add_special_tokens=False)
    assert len(item.chunks) == -(-len(ids) // 64) > 1 and "".join(item.chunks) == dialogue
    assert item.question == "\n\nDialogue: hi\nSummary:" and SPECS["samsum"].metric.__name__ == "rouge_l_score"
    assert item.score("They talk about a river") == 1.0
    with pytest.raises(ValueError, match="pass a tokenizer"):
        load_longbench_jsonl(path, "samsum")


def test_token_windows_keep_characters_split_across_tokens_whole(tiny_model_dir):
    """A byte-level BPE splits an emoji or a CJK character across tokens; a window ending between them
    decoded to U+FFFD, and the whole file was refused. The window takes the rest of the character."""
    from cachefuse.eval.longbench import split_tokens

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))
    context = "word " * 200 + "\U0001F600 \u6771\u4eac " * 40 + "end"
    for width in (7, 8, 16, 64):
        pieces = split_tokens(tokenizer, context, chunk_tokens=width)
        assert "".join(pieces) == context and not any(p.endswith("\ufffd") for p in pieces), width


@pytest.mark.parametrize(("line", "message"), [
    ("not json", "not valid JSON"), ("[1]", "expected a JSON object"),
    (json.dumps({"input": "q", "context": "", "answers": ["a"]}), "'context' is empty"),
    (json.dumps({"input": "q", "context": "c", "answers": []}), "'answers'"),
    (json.dumps({"context": "c", "answers": ["a"]}), "'input'")])
def test_bad_lines_name_the_line_and_field(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"input": "q", "context": "c", "answers": ["a"]}) + "\n\n" + line + "\n")
    with pytest.raises(ValueError, match=message) as exc:
        load_longbench_jsonl(path, "musique")
    assert ":3:" in str(exc.value)
    with pytest.raises(ValueError, match="expected one of"):
        load_longbench_jsonl(path, "narrativeqa")

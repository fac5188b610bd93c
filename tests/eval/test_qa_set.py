"""The real-text QA set (cachefuse/eval/qa_set.py, qa_world.py): seeded, split by entity, evidence
where it says, multi-document questions that no single document answers; the answer evidence rows (layer profiling's
evidence) are the tokens that spell the answer."""

from __future__ import annotations

import re
from dataclasses import asdict

import pytest

from cachefuse.eval.harness import exact_match
from cachefuse.eval.metrics import normalize_answer, qa_f1_score
from cachefuse.eval.qa_set import KINDS, LAYOUTS, QUESTIONS, SYSTEM_PROMPT, eval_items, make_items
from cachefuse.eval.qa_world import SPLITS, name_pools
from cachefuse.rag_prompt import build_rag_prompt, chat_pieces

NUM_ITEMS = 120


@pytest.fixture(scope="module")
def items():
    return {split: make_items(split, NUM_ITEMS, seed=0) for split in SPLITS}


def contains(text: str, phrase: str) -> bool:
    """`phrase` in `text` as whole words, after LongBench's normalisation."""
    return re.search(rf"\b{re.escape(normalize_answer(phrase))}\b", normalize_answer(text)) is not None


def test_items_are_the_same_for_the_same_seed_and_differ_across_seeds():
    assert [asdict(i) for i in make_items("validation", 12, seed=3)] == [
        asdict(i) for i in make_items("validation", 12, seed=3)]
    assert [asdict(i) for i in make_items("validation", 12, seed=3)] != [
        asdict(i) for i in make_items("validation", 12, seed=4)]
    assert make_items("validation", 5, seed=3) == make_items("validation", 8, seed=3)[:5]


def test_kinds_alternate_and_every_question_type_occurs(items):
    for split_items in items.values():
        assert [i.kind for i in split_items[:4]] == ["single", "multi", "single", "multi"]
        assert {i.question_type for i in split_items} == set(QUESTIONS)
        assert {i.kind for i in split_items} == set(KINDS)


def entity_words(split: str) -> set[str]:
    """Every word of every name in the split's pools, but the company kinds ("Works", "& Sons", ...),
    which are shared words, not names."""
    pools = name_pools(split)
    names = [*pools.female, *pools.male, *pools.surnames, *pools.towns, *pools.rivers, *pools.lakes]
    return set(names) | {c.split()[0] for c in pools.companies}


def test_splits_share_no_entity_and_no_name_word(items):
    assert entity_words("validation").isdisjoint(entity_words("test"))
    for split, split_items in items.items():
        other = entity_words(next(s for s in SPLITS if s != split))
        for item in split_items:
            text = " ".join(d.text for d in item.documents) + " " + item.question
            assert other.isdisjoint(re.findall(r"[A-Z][a-z]+", text)), item.question
            assert item.entity.removeprefix("the ").split()[0] in entity_words(split)


def test_documents_are_four_to_six_distinct_entities_of_natural_length(items):
    for item in items["validation"]:
        assert LAYOUTS["short"][0] <= len(item.documents) <= LAYOUTS["short"][1]
        assert len({d.title for d in item.documents}) == len(item.documents)
        for doc in item.documents:
            words = doc.body.split()
            assert 25 <= len(words) <= 110, doc.text  # about 40-150 tokens with a BPE tokenizer
            assert len(doc.facts) >= 2


def test_the_long_layout_asks_the_same_questions_over_more_documents(items):
    long_items = make_items("test", NUM_ITEMS, seed=0, layout="long")
    counts = [len(i.documents) for i in long_items]
    assert LAYOUTS["long"][0] <= min(counts) and max(counts) <= LAYOUTS["long"][1]
    assert len(set(counts)) > 1  # drawn per item, not a constant
    for short, long in zip(items["test"], long_items, strict=True):
        assert (long.question, long.stem, long.answers, long.kind) == (short.question, short.stem, short.answers, short.kind)
        assert len({d.title for d in long.documents}) == len(long.documents)
        # the short item's documents, word for word, among the long one's, the evidence included
        assert set(short.documents) <= set(long.documents)
        assert [long.documents[i] for i in long.evidence] == [short.documents[i] for i in short.evidence]
    with pytest.raises(ValueError, match="layout='longer'"):
        make_items("test", 1, layout="longer")


def test_every_answer_is_stated_in_its_evidence_document(items):
    for item in items["validation"] + items["test"]:
        assert contains(item.documents[item.evidence[-1]].body, item.answers[0]), item


def test_a_multi_question_needs_both_documents(items):
    multi = [i for i in items["validation"] + items["test"] if i.kind == "multi"]
    assert len(multi) == NUM_ITEMS  # half of each split
    for item in multi:
        first, second = (item.documents[i] for i in item.evidence)
        assert len(item.evidence) == 2 and first is not second
        assert contains(first.body, item.bridge) and contains(second.text, item.bridge)
        for doc in item.documents:  # no document holds both the question's entity and the answer
            assert not (contains(doc.text, item.entity) and contains(doc.text, item.answers[0])), (item, doc)
        assert not contains(item.question, item.bridge) and not contains(item.question, item.answers[0])


def test_the_bridge_and_the_answer_sit_mid_document(items):
    """The dependency is never in a document's first sentence, so never at a chunk's first tokens."""
    for item in items["validation"] + items["test"]:
        if item.kind != "multi":
            continue
        first, second = (item.documents[i] for i in item.evidence)
        assert not contains(first.opening, item.bridge), first.text
        assert not contains(second.opening, item.answers[0]), second.text


def test_each_question_has_one_answer_among_the_distractors(items):
    """A distractor of the same type states a different value: the answer is not guessed by type."""
    for item in items["validation"]:
        holders = [d for d in item.documents if contains(d.body, item.answers[0])]
        assert item.documents[item.evidence[-1]] in holders
        if item.question_type in ("town_river", "birth_town_river", "town_specialty", "birth_town_specialty"):
            # one town states it (the river's own document, titled by it, may be there too)
            assert len([d for d in holders if not contains(d.title, item.answers[0])]) == 1, item


def test_f1_and_em_score_the_answer_forms():
    item = next(i for i in make_items("validation", 20) if i.question_type.endswith("river"))
    river = item.answers[0]
    assert item.answers == (river, f"river {river}", f"{river} River")
    assert max(exact_match(f" the river {river}.", a) for a in item.answers) == 1.0
    assert max(qa_f1_score(f" {river}, which floods in spring", a) for a in item.answers) == pytest.approx(1 / 3)  # P 1/5, R 1
    assert qa_f1_score("woollen blankets and lace", "woollen blankets") == pytest.approx(2 * 0.5 / 1.5)
    assert qa_f1_score("The cello.", "cello") == 1.0 and exact_match("The cello.", "cello") == 1.0
    assert qa_f1_score("violin", "cello") == 0.0


def test_eval_items_follow_the_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))
    qa = make_items("test", 2)
    pieces = chat_pieces(tokenizer, SYSTEM_PROMPT)
    for q, item in zip(qa, eval_items(qa, tokenizer), strict=True):
        assert item.kind == q.kind and item.answers == q.answers
        assert item.system == pieces.system and item.chunks == tuple(d.text for d in q.documents)
        assert item.question.endswith(pieces.question_suffix + q.stem) and q.question in item.question
        prompt = build_rag_prompt(tokenizer, item.system, item.chunks, item.question)
        assert len(prompt.chunks) == 1 + len(q.documents)
    plain = eval_items(qa)[0]
    assert plain.system == SYSTEM_PROMPT + "\n" and plain.question.endswith("\nAnswer: " + qa[0].stem)


def test_answer_evidence_rows_spell_the_answer(tiny_model_dir):
    from transformers import AutoTokenizer

    from cachefuse.eval.qa_set import answer_evidence_rows, eval_items, make_items

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))
    items = make_items("validation", 6)
    found = 0
    for item, eval_item in zip(items, eval_items(items, tokenizer), strict=True):
        prompt, rows = answer_evidence_rows(item, eval_item, tokenizer)
        text = tokenizer.decode([prompt.token_ids[r] for r in rows]).lower()
        assert all(prompt.chunks[1][0] <= r < prompt.chunks[-1][1] for r in rows)
        if rows:
            found += 1
            assert any(answer.lower().split()[0] in text for answer in item.answers), (text, item.answers)
    assert found >= 5  # the answer is written in its document (a rare tokenizer mismatch drops one)

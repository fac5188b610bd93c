"""The RAG probe's task (cachefuse/eval/probe_task.py): seeded, shortcut-free by construction."""

from __future__ import annotations

import random
from collections import Counter

from cachefuse.eval.probe_task import (
    ProbeVocab,
    build_probe_tokenizer,
    make_items,
    sample_markov_sequence,
    sample_train_sequence,
)
from cachefuse.rag_prompt import build_rag_prompt


def test_items_are_the_same_for_the_same_seed_and_differ_across_seeds():
    assert [i.to_dict() for i in make_items(3, 20)] == [i.to_dict() for i in make_items(3, 20)]
    assert [i.to_dict() for i in make_items(3, 20)] != [i.to_dict() for i in make_items(4, 20)]


def test_each_item_asks_a_fact_of_its_kind():
    for item in make_items(0, 200):
        words = " ".join(item.chunks).split()
        name = item.question.split()[1]
        assert words.count(name) == 1, "names are unique within a stream"
        at = words.index(name)
        assert words[at - 1] == item.answer
        # Whether the name starts a chunk (its value ending the one before) decides the kind.
        starts, total = [], 0
        for chunk in item.chunks:
            starts.append(total)
            total += len(chunk.split())
        split = at in starts[1:]
        assert split == (item.kind == "cross_chunk"), item


def test_kinds_alternate_and_boundaries_split_facts_about_half_the_time():
    items = make_items(1, 400)
    assert Counter(i.kind for i in items) == {"same_chunk": 200, "cross_chunk": 200}
    splits = [i.meta["num_split_boundaries"] for i in items]
    assert 0.3 < sum(splits) / (5 * len(items)) < 0.7


def test_values_come_from_one_pool_whatever_the_name():
    """No value type per name: over many streams, every name is seen with most values."""
    vocab = ProbeVocab.default()
    rng = random.Random(0)
    seen: dict[str, set[str]] = {}
    for _ in range(400):
        seq = sample_train_sequence(rng, vocab, 8, 4)
        for a, b in zip(seq.words, seq.words[1:], strict=False):
            if b in vocab.names:
                seen.setdefault(b, set()).add(a)
    assert min(len(v) for v in seen.values()) > len(vocab.values) // 3


def test_training_answers_are_the_values_before_their_names():
    vocab = ProbeVocab.default()
    seq = sample_train_sequence(random.Random(5), vocab, 6, 12)
    assert len(seq.answer_positions) == 6  # distinct facts only
    for pos in seq.answer_positions:
        name, value = seq.words[pos - 1], seq.words[pos]
        assert seq.words[pos - 2] == "?"
        assert seq.words.index(name) < pos - 2 and seq.words[seq.words.index(name) - 1] == value


def test_markov_warmup_is_a_fixed_order_two_chain():
    vocab = ProbeVocab.default()
    seq = sample_markov_sequence(random.Random(0), vocab, length=200, noise=0.0)
    symbols = seq.words[1:]
    table = {}
    for a, b, c in zip(symbols, symbols[1:], symbols[2:], strict=False):
        assert table.setdefault((a, b), c) == c
    assert set(symbols) <= set(vocab.markov)


def test_tokenizer_keeps_every_word_one_token(tmp_path):
    vocab = ProbeVocab.default()
    tokenizer = build_probe_tokenizer(vocab, tmp_path)
    item = make_items(0, 1)[0]
    prompt = build_rag_prompt(tokenizer, item.system, item.chunks, item.question)
    words = [item.system, *item.chunks, item.question]
    assert len(prompt.token_ids) == 1 + sum(len(w.split()) for w in words)
    assert tokenizer.convert_ids_to_tokens(prompt.token_ids[-1]) == item.question.split()[1]
    assert (tmp_path / "tokenizer.json").exists()

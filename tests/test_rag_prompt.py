"""cachefuse.rag_prompt: RAG prompts built from pieces tokenized on their own, and chat templates cut into them."""

import json

import pytest

from cachefuse.chunks import KeyContext, Segment, chunk_key, chunks_from_texts, segment_prompt
from cachefuse.rag_prompt import RagPrompt, build_rag_prompt, chat_pieces, tokenize_piece


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


class CharTokenizer:
    """One id per character and no BOS: the no-BOS path of build_rag_prompt."""

    bos_token_id = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


# --------------------------------------------------------------------------- build_rag_prompt


SYSTEM = "You answer questions from the documents.\n"
DOCS = ["Alice visited Paris in 1999.\n", "The museum opens on Monday.\n", "Bob built a bridge.\n"]
QUESTION = "Question: when did Alice visit Paris?\nAnswer:"


def test_build_rag_prompt_ids(tokenizer):
    prompt = build_rag_prompt(tokenizer, SYSTEM, DOCS, QUESTION)
    pieces = [tokenize_piece(tokenizer, SYSTEM, add_bos=True)] + [tokenize_piece(tokenizer, d) for d in DOCS]
    assert prompt.token_ids == [t for p in pieces for t in p] + tokenize_piece(tokenizer, QUESTION)
    assert prompt.chunk_token_ids == pieces
    assert len(prompt.chunks) == 1 + len(DOCS) and prompt.chunks[0][0] == 0
    for (s, e), ids in zip(prompt.chunks, prompt.chunk_token_ids, strict=True):
        assert prompt.token_ids[s:e] == ids
    s, e = prompt.question
    assert prompt.token_ids[s:e] == tokenize_piece(tokenizer, QUESTION) and e == prompt.num_tokens
    bos = tokenizer.bos_token_id
    assert prompt.token_ids[0] == bos and prompt.token_ids.count(bos) == 1
    # each chunk's ids are its standalone tokenization, so chunks_from_texts finds the same spans
    assert chunks_from_texts(prompt.token_ids, prompt.chunk_token_ids[1:]) == prompt.chunks[1:]


def test_build_rag_prompt_kv_transfer_params(tokenizer):
    prompt = build_rag_prompt(tokenizer, SYSTEM, DOCS, QUESTION)
    params = prompt.kv_transfer_params()
    assert params == {"cachefuse": {"chunks": [list(c) for c in prompt.chunks]}}
    json.dumps(params)
    segments = segment_prompt(prompt.num_tokens, params["cachefuse"]["chunks"])
    assert [s.is_chunk for s in segments] == [True] * 4 + [False]
    assert segments[0].is_system and not any(s.is_system for s in segments[1:])


def test_chunk_key_independent_of_prompt_position(tokenizer):
    ctx = KeyContext("f" * 32, "float32")
    a = build_rag_prompt(tokenizer, SYSTEM, DOCS, QUESTION)
    b = build_rag_prompt(tokenizer, "Other system.\n", DOCS[::-1], "Why?")
    keys_a = {chunk_key(a.token_ids[s:e], ctx) for s, e in a.chunks[1:]}
    keys_b = {chunk_key(b.token_ids[s:e], ctx) for s, e in b.chunks[1:]}
    assert keys_a == keys_b and len(keys_a) == len(DOCS)


def test_build_rag_prompt_without_system(tokenizer):
    prompt = build_rag_prompt(tokenizer, "", DOCS[:1], QUESTION)
    assert prompt.token_ids[0] == tokenizer.bos_token_id
    assert prompt.chunks == [(1, 1 + len(tokenize_piece(tokenizer, DOCS[0])))]
    segments = segment_prompt(prompt.num_tokens, prompt.chunks)
    assert segments[0] == Segment(0, 1, is_chunk=False, is_system=False)
    assert not any(s.is_system for s in segments)


def test_build_rag_prompt_without_bos():
    prompt = build_rag_prompt(CharTokenizer(), "", ["ab", "c"], "?")
    assert prompt == RagPrompt(
        token_ids=[97, 98, 99, 63], chunks=[(0, 2), (2, 3)], chunk_token_ids=[[97, 98], [99]], question=(3, 4)
    )
    # the first retrieved chunk sits at offset 0 here, so segment_prompt treats it as the system chunk
    assert segment_prompt(4, prompt.chunks)[0].is_system


def test_build_rag_prompt_rejects_empty_chunk(tokenizer):
    with pytest.raises(ValueError, match=r"chunks\[1\]"):
        build_rag_prompt(tokenizer, SYSTEM, ["a\n", ""], QUESTION)


# --------------------------------------------------------------------------- chat_pieces


def test_chat_pieces_rebuild_the_rendered_conversation(tokenizer):
    pieces = chat_pieces(tokenizer, "Answer briefly.", examples=[("Is water wet?", "Yes.")])
    prompt = build_rag_prompt(tokenizer, pieces.system, ["doc one\n", "doc two\n"], "why?" + pieces.question_suffix)
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Is water wet?"},
         {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "doc one\ndoc two\nwhy?"}],
        tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(prompt.token_ids) == rendered
    assert prompt.token_ids.count(tokenizer.bos_token_id) == 1, "BOS once: the template's BOS text is cut"
    assert not pieces.system.startswith(tokenizer.bos_token) and "Yes." in pieces.system


def test_chat_pieces_without_a_template_is_none():
    assert chat_pieces(CharTokenizer(), "Answer briefly.") is None

"""RAG prompts built from text: each piece tokenized on its own, its chunks declared (docs/architecture.md).

A prompt `[system][chunk 1]...[chunk n][question]` is assembled from pieces tokenized separately, so
that the client, the offline jobs that fill the store and the server's `chunk_texts` tokenization all
see the same ids for a chunk wherever it sits. Tokenizers are passed in (anything with `encode(text,
add_special_tokens=False)` and `bos_token_id`, such as a transformers tokenizer); `chat_pieces` cuts a
chat template into the system and question pieces. Imports only the standard library and
cachefuse.chunks: the scheduler tokenizes `chunk_texts` with `tokenize_piece`, without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachefuse.chunks import PARAMS_KEY


def tokenize_piece(tokenizer: Any, text: str, *, add_bos: bool = False) -> list[int]:
    """Tokenizes one prompt piece on its own, without special tokens; `add_bos` prepends BOS if any."""
    ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if add_bos and bos_id is not None:
        ids.insert(0, int(bos_id))
    return ids


@dataclass(frozen=True)
class RagPrompt:
    """A `[system][chunk 1]...[chunk n][question]` prompt and its declared chunks."""

    token_ids: list[int]
    chunks: list[tuple[int, int]]
    """Declared chunks as `[start, end)`: the system prompt first (at offset 0), then the retrieved chunks."""
    chunk_token_ids: list[list[int]]
    """The ids of each declared chunk, in the order of `chunks`."""
    question: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def kv_transfer_params(self) -> dict:
        """The request field that declares the chunks: `{"cachefuse": {"chunks": [[s, e], ...]}}`."""
        return {PARAMS_KEY: {"chunks": [[s, e] for s, e in self.chunks]}}


def build_rag_prompt(tokenizer: Any, system: str, chunks: Sequence[str], question: str) -> RagPrompt:
    """Assembles a RAG prompt from pieces tokenized on their own, so that client, store and a plain
    run see the same ids.

    Texts are used exactly as given: a separator between pieces (e.g. a trailing "\\n" or "\\n\\n")
    belongs in the piece's own text, where it becomes part of that chunk's ids and key. BOS (if the
    tokenizer has one) is prepended to the system piece only, so the system chunk is `[BOS] +
    ids(system)`. With an empty `system` there is no system chunk and BOS, if any, is a computed
    1-token segment at offset 0.

    Args:
        tokenizer: e.g. a transformers tokenizer (`encode`, `bos_token_id`).
        system: the system prompt, declared as the chunk at offset 0 unless empty.
        chunks: the retrieved chunk texts, each declared as a chunk.
        question: computed in full; may be empty.

    Returns:
        The prompt's ids, declared chunks with their ids, and the question's range.

    Raises:
        ValueError: a chunk text tokenizes to no tokens.
    """
    token_ids: list[int] = []
    spans: list[tuple[int, int]] = []
    span_ids: list[list[int]] = []
    if system:
        sys_ids = tokenize_piece(tokenizer, system, add_bos=True)
        spans.append((0, len(sys_ids)))
        span_ids.append(sys_ids)
        token_ids.extend(sys_ids)
    else:
        token_ids.extend(tokenize_piece(tokenizer, "", add_bos=True))
    for i, text in enumerate(chunks):
        ids = tokenize_piece(tokenizer, text)
        if not ids:
            raise ValueError(f"chunks[{i}]={text!r} tokenizes to no tokens; expected a non-empty text")
        spans.append((len(token_ids), len(token_ids) + len(ids)))
        span_ids.append(ids)
        token_ids.extend(ids)
    question_ids = tokenize_piece(tokenizer, question)
    question_span = (len(token_ids), len(token_ids) + len(question_ids))
    token_ids.extend(question_ids)
    return RagPrompt(token_ids=token_ids, chunks=spans, chunk_token_ids=span_ids, question=question_span)


@dataclass(frozen=True)
class ChatPieces:
    """A chat template cut around the user's message, for `build_rag_prompt`'s system and question."""

    system: str
    """The template up to the user message's content: system turn and the opened user turn, without
    the BOS text that `build_rag_prompt` prepends as a token."""
    question_suffix: str
    """What follows the user message's content: the user turn closed, the assistant's opened."""


_USER_MARK = "\ue000cachefuse-user-content\ue000"  # a private-use character no template writes


def chat_pieces(tokenizer: Any, system: str, examples: Sequence[tuple[str, str]] = ()) -> ChatPieces | None:
    """Cuts the tokenizer's chat template for `[system][documents][question]` prompts.

    The rendered conversation `[{system}, {user: <documents and question>}]` with the generation
    prompt is split at the user's content, so that the system chunk carries the system turn and the
    user turn's header, retrieved chunks follow as the user's text, and the question piece ends with
    `question_suffix`. For ChatML (SmolLM2, Qwen):

    ```
    | <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n | doc 1 | doc 2 | question<|im_end|>\\n<|im_start|>assistant\\n |
      ^ BOS, prepended by build_rag_prompt
    ```

    Args:
        tokenizer: a transformers tokenizer (`chat_template`, `apply_chat_template`, `bos_token`).
        system: the system message's content.
        examples: (user, assistant) turns between the system message and the user's, a worked
            example (few-shot); they become part of the system piece.

    Returns:
        The two pieces, or None when the tokenizer has no chat template.

    Raises:
        ValueError: the template drops or repeats the user's content, or rejects a system message.
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    turns = [{"role": role, "content": content} for pair in examples
             for role, content in zip(("user", "assistant"), pair, strict=True)]
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, *turns, {"role": "user", "content": _USER_MARK}],
        tokenize=False, add_generation_prompt=True)
    if text.count(_USER_MARK) != 1:
        raise ValueError("the chat template does not render the user's content exactly once")
    head, tail = text.split(_USER_MARK)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and getattr(tokenizer, "bos_token_id", None) is not None and head.startswith(bos):
        head = head[len(bos):]  # build_rag_prompt prepends BOS as a token
    return ChatPieces(system=head, question_suffix=tail)

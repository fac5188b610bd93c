"""LongBench-format datasets as RAG prompts: `[system][passages][question]`, scored as LongBench does.

Imports the standard library and cachefuse.{chunks, eval.metrics, jsonl}. A LongBench JSONL line holds
`input` (the question), `context`, `answers` (a list), `_id` and more; this module turns each into
the pieces `build_rag_prompt` assembles, with the context split into declared chunks by a rule per
dataset:

| dataset | split rule | metric |
|---|---|---|
| `hotpotqa`, `2wikimqa`, `musique` | at the `Passage N:` markers LongBench writes before each passage | `qa_f1_score` |
| `samsum`, `multi_news` | fixed windows of `chunk_tokens` (512) tokens, as CacheBlend does | ROUGE-L |

The system and question texts are LongBench's prompt for the dataset (its `dataset2prompt`) cut at
`{context}`: the part before is the system prompt (chunk 0), the part after, with `{input}` filled,
is the question. Joining the chunks gives back the context exactly (passage splits keep every
character; token windows are decoded, which for byte-level BPE tokenizers is exact, and checked).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachefuse.eval.metrics import best_score, qa_f1_score, rouge_l_score
from cachefuse.jsonl import read_jsonl
from cachefuse.rag_prompt import RagPrompt, build_rag_prompt

_QA_INSTRUCTION = ("Answer the question based on the given passages. Only give me the answer and do not output "
                   "any other words.")


@dataclass(frozen=True)
class DatasetSpec:
    """How one LongBench dataset becomes a RAG prompt and how its answers are scored."""

    split: str
    """"passages" (at the Passage N: markers) or "tokens" (fixed windows)."""
    metric: Callable[[str, str], float]
    system: str
    """The prompt text before the context (the system chunk)."""
    question: str
    """The prompt text after the context; `{input}` is the item's input."""


SPECS: dict[str, DatasetSpec] = {
    **{name: DatasetSpec("passages", qa_f1_score, f"{_QA_INSTRUCTION}\n\nThe following are given passages.\n",
                         f"\n\n{_QA_INSTRUCTION}\n\nQuestion: {{input}}\nAnswer:")
       for name in ("hotpotqa", "2wikimqa", "musique")},
    "multi_news": DatasetSpec("tokens", rouge_l_score,
                              "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n",
                              "\n\nNow, write a one-page summary of all the news.\n\nSummary:"),
    "samsum": DatasetSpec("tokens", rouge_l_score,
                          "Summarize the dialogue into a few short sentences. The following are some examples.\n\n",
                          "\n\n{input}"),
}

_PASSAGE_MARKER = re.compile(r"(?=Passage \d+:\n)")


@dataclass(frozen=True)
class LongBenchItem:
    id: str
    dataset: str
    system: str
    chunks: tuple[str, ...]
    question: str
    answers: tuple[str, ...]

    def prompt(self, tokenizer: Any) -> RagPrompt:
        """The token ids and declared chunks (`build_rag_prompt`)."""
        return build_rag_prompt(tokenizer, self.system, list(self.chunks), self.question)

    def score(self, prediction: str) -> float:
        """LongBench's score of `prediction`: the dataset's metric, best over the reference answers."""
        return best_score(SPECS[self.dataset].metric, prediction, self.answers)


def split_passages(context: str) -> list[str]:
    """The context cut before every `Passage N:` marker; text before the first marker, if any, is a
    chunk of its own. Every character is kept (the chunks join back to the context)."""
    return [piece for piece in _PASSAGE_MARKER.split(context) if piece]


def split_tokens(tokenizer: Any, context: str, chunk_tokens: int = 512) -> list[str]:
    """The context as decoded windows of `chunk_tokens` tokens (no special tokens).

    Raises:
        ValueError: decoding does not give the context back (a tokenizer that is not lossless).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r}, expected >= 1")
    ids = tokenizer.encode(context, add_special_tokens=False)
    pieces, start = [], 0
    while start < len(ids):
        end = min(start + chunk_tokens, len(ids))
        piece = tokenizer.decode(ids[start:end])
        # A byte-level BPE may split one character (an emoji, CJK) across tokens: a window ending between
        # them decodes to U+FFFD. It takes the next tokens (at most 3: UTF-8 has 4 bytes a character).
        for _ in range(3):
            if not piece.endswith("\ufffd") or end == len(ids):
                break
            end += 1
            piece = tokenizer.decode(ids[start:end])
        pieces.append(piece)
        start = end
    if "".join(pieces) != context:
        raise ValueError("split_tokens: the tokenizer does not decode windows back to the context; "
                         "use a byte-level BPE tokenizer or split by passages")
    return pieces


def load_longbench_jsonl(path: str | Path, dataset: str, tokenizer: Any = None,
                         chunk_tokens: int = 512, limit: int | None = None) -> list[LongBenchItem]:
    """Reads a LongBench JSONL file of `dataset` (one of SPECS) into items.

    Args:
        path: the JSONL file (LongBench's `data/<dataset>.jsonl`).
        dataset: its name; decides the split rule, the prompt and the metric.
        tokenizer: needed for the "tokens" split rule.
        chunk_tokens: window size of the "tokens" rule.
        limit: read at most this many items.

    Raises:
        ValueError: an unknown dataset, or a line that is not a LongBench item (names line and field).
    """
    if dataset not in SPECS:
        raise ValueError(f"dataset={dataset!r}: expected one of {', '.join(sorted(SPECS))}")
    spec = SPECS[dataset]
    if spec.split == "tokens" and tokenizer is None:
        raise ValueError(f"dataset {dataset!r} is split into {chunk_tokens}-token windows: pass a tokenizer")
    items: list[LongBenchItem] = []
    for where, number, value in read_jsonl(path, "LongBench file"):
        if limit is not None and len(items) >= limit:
            break
        row = _check_row(value, where)
        context = row["context"]
        chunks = split_passages(context) if spec.split == "passages" else split_tokens(tokenizer, context,
                                                                                       chunk_tokens)
        items.append(LongBenchItem(str(row.get("_id", number)), dataset, spec.system, tuple(chunks),
                                   spec.question.format(input=row["input"]), tuple(row["answers"])))
    return items


def _check_row(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object")
    for name in ("input", "context"):
        if not isinstance(row.get(name), str):
            raise ValueError(f"{where}: field {name!r} must be a string")
    if not row["context"]:
        raise ValueError(f"{where}: field 'context' is empty")
    answers = row.get("answers")
    if not (isinstance(answers, list) and answers and all(isinstance(a, str) for a in answers)):
        raise ValueError(f"{where}: field 'answers' must be a non-empty list of strings")
    return row


def mean_score(items: Sequence[LongBenchItem], predictions: Sequence[str]) -> float:
    """The dataset score LongBench reports: the mean item score, x 100."""
    if len(items) != len(predictions) or not items:
        raise ValueError(f"{len(items)} items, {len(predictions)} predictions: expected equal, non-zero")
    return 100.0 * sum(item.score(p) for item, p in zip(items, predictions, strict=True)) / len(items)

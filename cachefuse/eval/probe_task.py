"""The RAG probe's synthetic task: facts in a token stream, questions that need a chunk's neighbour.

Imports only the standard library (the tokenizer builder imports tokenizers and transformers).
`benchmarks/train_probe.py` trains the probe model on it; `benchmarks/quality.py`, `cachefuse eval
--probe` and the CI test evaluate on it. Everything is drawn from a seeded `random.Random`, so the
same seed gives the same items on every machine.

A context is a stream of facts `VALUE NAME` ("kif of Bado") with filler words between them. Names
are unique within a stream; values come from one shared pool (any value may precede any name, and
repeat), so a value carries no hint of its name. A question `? NAME` asks for the value just before
NAME in the stream:

```
system:   <bos> facts :
stream:   kif Bado and zot Lumi so so kif Pera ... wex | Gonu then ...
                                                       ^ chunk boundary: the fact "wex Gonu" straddles it
question: ? Gonu          answer: wex
```

Answering is associative recall: the question's NAME finds the NAME in the stream, whose K/V must
carry "my previous token is VALUE". When the stream is cut into chunks and a fact straddles a
boundary, the NAME is the first token of the next chunk; a chunk's K/V computed on its own (full
reuse) cannot know the value before it, so only recomputing that token restores the answer
(cross-chunk question). A same-chunk question's fact lies inside one chunk, and reuse leaves it
answerable.

NOTE: the order VALUE NAME, not NAME VALUE: with the name first the question must match its name
against a feature the previous-token head moved into the value (K-composition), which a model this
small learned too slowly on 2 CPU cores (chance among the stream's values after 4,000 steps); with
the value first the question matches the name token itself and reads what that token carries.

Shortcuts removed (docs/quality.md, "The RAG probe", says which ones earlier designs learned):

- No chunk markers: training streams have no chunk boundaries at all, so no position or token tells
  a model where a straddling value sits.
- One shared value pool, drawn uniformly: the question's name says nothing about the value's type.
- Retrieval is gated first: the gate demands >= 80% exact match on same-chunk questions.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

BOS, EOS, PAD, UNK = "<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>"
SYSTEM_WORDS = ("facts", ":")
QUESTION_MARK = "?"
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _words(rng: random.Random, count: int, shape: str) -> list[str]:
    """`count` distinct pseudo-words shaped like `shape` ("c": a consonant, "v": a vowel)."""
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(_CONSONANTS if s == "c" else _VOWELS) for s in shape))
    return sorted(words)


@dataclass(frozen=True)
class ProbeVocab:
    """The probe's word list: names, values and fillers are disjoint; every word is one token."""

    names: tuple[str, ...]
    values: tuple[str, ...]
    fillers: tuple[str, ...]
    markov: tuple[str, ...] = tuple(f"m{i:02d}" for i in range(16))
    """Symbols of the warm-up sequences only (`sample_markov_sequence`); never in a fact stream."""

    @classmethod
    def default(cls, num_names: int = 64, num_values: int = 64) -> ProbeVocab:
        rng = random.Random(20261122)
        names = [w.capitalize() for w in _words(rng, num_names, "cvcv")]  # "Bado"
        values = _words(rng, num_values, "cvc")  # "kif"
        fillers = ("and", "then", "so", "also", "the", "note", "well", "ok")
        return cls(tuple(names), tuple(values), fillers)

    @property
    def words(self) -> list[str]:
        """Every token, specials first: the tokenizer's vocabulary in id order."""
        return [BOS, EOS, PAD, UNK, *SYSTEM_WORDS, QUESTION_MARK, *self.names, *self.values, *self.fillers,
                *self.markov]


def build_probe_tokenizer(vocab: ProbeVocab, out_dir: str | Path | None = None):
    """A word-level `PreTrainedTokenizerFast` over `vocab` (split on whitespace), saved to `out_dir` if given."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = {word: i for i, word in enumerate(vocab.words)}
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                     unk_token=UNK, clean_up_tokenization_spaces=False)
    if out_dir is not None:
        hf_tok.save_pretrained(str(out_dir))
    return hf_tok


@dataclass(frozen=True)
class Fact:
    name: str
    value: str
    position: int
    """Index of the name in the stream (the value is at position - 1)."""


@dataclass(frozen=True)
class Stream:
    words: tuple[str, ...]
    facts: tuple[Fact, ...]


def sample_stream(rng: random.Random, vocab: ProbeVocab, num_facts: int, filler_mean: float = 1.0) -> Stream:
    """`num_facts` facts with unique names, separated by a geometric number of fillers (mean `filler_mean`)."""
    names = rng.sample(vocab.names, num_facts)
    words: list[str] = []
    facts = []
    stop = 1.0 / (1.0 + filler_mean)
    for name in names:
        while rng.random() > stop:
            words.append(rng.choice(vocab.fillers))
        facts.append(Fact(name, rng.choice(vocab.values), len(words) + 1))
        words += [facts[-1].value, name]
    return Stream(tuple(words), tuple(facts))


# --------------------------------------------------------------------------- training sequences


@dataclass(frozen=True)
class TrainSequence:
    words: list[str]
    answer_positions: list[int]
    """Indices in `words` (after BOS and the system words) of the answers to predict."""


def sample_train_sequence(rng: random.Random, vocab: ProbeVocab, num_facts: int, num_questions: int,
                          filler_mean: float = 1.0) -> TrainSequence:
    """`<bos> facts : <stream> ? n a ? n a ...`: questions on distinct facts of the stream, in random order."""
    stream = sample_stream(rng, vocab, num_facts, filler_mean)
    words = [BOS, *SYSTEM_WORDS, *stream.words]
    answers = []
    for fact in rng.sample(stream.facts, min(num_questions, num_facts)):
        words += [QUESTION_MARK, fact.name, fact.value]
        answers.append(len(words) - 1)
    return TrainSequence(words, answers)


_MARKOV_TABLE_SEED = 99


def sample_markov_sequence(rng: random.Random, vocab: ProbeVocab, length: int = 24,
                           noise: float = 0.1) -> TrainSequence:
    """`<bos> m m m ...`: an order-2 Markov chain over `vocab.markov` whose next symbol is a fixed random
    function of the two before it (a uniform symbol with probability `noise`); every symbol from the
    third on is a target.

    NOTE: a warm-up task, mixed into training batches. Predicting it needs a previous-token head
    (each position must see the token before it), the half of the recall circuit that answer-only
    supervision leaves on a long plateau; with it learned, recall builds on it.
    """
    n = len(vocab.markov)
    table = random.Random(_MARKOV_TABLE_SEED)
    step = [[table.randrange(n) for _ in range(n)] for _ in range(n)]
    symbols = [rng.randrange(n), rng.randrange(n)]
    while len(symbols) < length:
        symbols.append(rng.randrange(n) if rng.random() < noise else step[symbols[-2]][symbols[-1]])
    return TrainSequence([BOS, *(vocab.markov[i] for i in symbols)], list(range(3, length + 1)))


# --------------------------------------------------------------------------- evaluation items

KINDS = ("same_chunk", "cross_chunk")


@dataclass(frozen=True)
class ProbeItem:
    """One evaluation prompt: `[system][chunks][question]` and the one-token answer."""

    system: str
    chunks: tuple[str, ...]
    question: str
    answer: str
    kind: str
    """"same_chunk": the asked fact lies in one chunk; "cross_chunk": its value ends one chunk and its
    name starts the next."""
    meta: dict = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict:
        return {"system": self.system, "chunks": list(self.chunks), "question": self.question,
                "answer": self.answer, "kind": self.kind}


def _cut_points(rng: random.Random, stream: Stream, num_chunks: int, split_first: int | None) -> list[int]:
    """Boundaries near equal-length cuts; each either splits the nearest fact (value | name) or falls
    before its value. The boundary `split_first` (0-based), if given, always splits its fact."""
    name_positions = [f.position for f in stream.facts]
    cuts = []
    for b in range(1, num_chunks):
        target = round(b * len(stream.words) / num_chunks)
        position = min(name_positions, key=lambda p: (abs(p - target), p))
        split = b - 1 == split_first or rng.random() < 0.5
        cuts.append(position if split else position - 1)
    return cuts


def make_item(rng: random.Random, vocab: ProbeVocab, kind: str, num_chunks: int = 6,
              facts_per_chunk: int = 2, filler_mean: float = 1.0) -> ProbeItem:
    """One item of `kind`: a stream of num_chunks * facts_per_chunk facts cut into `num_chunks` chunks.

    About half of the boundaries split a fact. A cross-chunk item asks about a fact split by a
    boundary (one is forced); a same-chunk item asks about a fact inside a chunk.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}, expected one of {', '.join(KINDS)}")
    if num_chunks < 2:
        raise ValueError(f"num_chunks={num_chunks}, expected >= 2 (a cross-chunk fact needs a boundary)")
    while True:
        stream = sample_stream(rng, vocab, num_chunks * facts_per_chunk, filler_mean)
        forced = rng.randrange(num_chunks - 1) if kind == "cross_chunk" else None
        cuts = _cut_points(rng, stream, num_chunks, forced)
        if len(set(cuts)) == len(cuts) and all(a < b for a, b in pairwise([0, *cuts, len(stream.words)])):
            break
    bounds = [0, *cuts, len(stream.words)]
    split = set(cuts) & {f.position for f in stream.facts}  # names that start a chunk after their value
    candidates = [f for f in stream.facts if (f.position in split) == (kind == "cross_chunk")]
    fact = rng.choice(candidates)
    chunks = tuple(" ".join(stream.words[a:b]) for a, b in pairwise(bounds))
    return ProbeItem(system=" ".join(SYSTEM_WORDS), chunks=chunks, question=f"{QUESTION_MARK} {fact.name}",
                     answer=fact.value, kind=kind,
                     meta={"num_split_boundaries": len(split), "fact_position": fact.position})


def make_items(seed: int, num_items: int, vocab: ProbeVocab | None = None, **kwargs) -> list[ProbeItem]:
    """`num_items` items, alternating same-chunk and cross-chunk, from `random.Random(seed)`."""
    vocab = vocab or ProbeVocab.default()
    rng = random.Random(seed)
    return [make_item(rng, vocab, KINDS[i % 2], **kwargs) for i in range(num_items)]


def split_of(items: Sequence[ProbeItem], kind: str) -> list[int]:
    """Indices of the items of `kind`."""
    return [i for i, item in enumerate(items) if item.kind == kind]

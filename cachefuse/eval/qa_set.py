"""The real-text RAG QA set: questions about an invented world (cachefuse/eval/qa_world.py), answered
from 4 to 6 retrieved documents (layout `short`, the default; `long`: 10 to 12), in a validation and a
test split that share no entity.

Imports the standard library and cachefuse.{chunks, eval.qa_world}; `eval_items` imports the harness.
Every item is drawn from `random.Random(f"cachefuse-qa/{split}/{seed}/{index}")`: the same split,
seed and index give the same item on every machine and Python.

Layouts (`LAYOUTS`): an item's question, answer and evidence are drawn before its document count, so
item i of the `long` layout asks what item i of `short` asks, over 10-12 documents (about 710-880 SmolLM2
tokens, against 320-570) of which the extra ones are distractors of the same world: a longer retrieved
context at the same question, the regime where reused K/V saves most prefill.

Two kinds, alternating (`EvalItem.kind`, so the report splits by kind):

- `single`: the answer is stated in one document (a person's instrument, a town's river, ...);
- `multi`: two hops over two documents. The first document states, mid-paragraph, the bridge (the
  town where a person was born, the company they work for, the river a town lies on); the second
  states, mid-paragraph, the bridge's attribute that answers. No document holds both the question's
  entity and the answer, so a chunk's K/V computed on its own (full reuse) lacks what links them:
  the link is made by attention across chunks, which cache fusion must restore.

```
| system | doc (distractor) | doc A: ...X was born in T... | doc (distractor) | doc B: ...T lies on the river R... | question |
```

The other documents describe entities of the same types (other people, towns, companies and
rivers), among them the parallel chain of another person, so a guess by type is wrong. Answers are
names or short noun phrases, scored with LongBench's token F1 and exact match
(cachefuse.eval.metrics). Prompts follow the model's chat template where it has one
(cachefuse.rag_prompt.chat_pieces): the system chunk holds the system turn and opens the user's, the
question closes it, opens the assistant's and starts the answer with a stem that ends where the
answer begins ("The town where Maren Holloway was born lies on the river").
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cachefuse.eval.qa_world import (
    SPLITS,
    Document,
    World,
    company_document,
    name_pools,
    person_document,
    river_document,
    sample_world,
    town_document,
)

if TYPE_CHECKING:
    from cachefuse.eval.harness import EvalItem

KINDS = ("single", "multi")
SYSTEM_PROMPT = ("You answer questions using only the documents the user gives you. "
                 "Reply with the answer alone, in a few words: a name or a short phrase, not a sentence.")
QUESTION_TEMPLATE = "Question: {question}\nAnswer in a few words."
LAYOUTS = {"short": (4, 6), "long": (10, 12)}
"""Retrieved documents per item, (fewest, most), by layout. A world holds 14 entities (sample_world's
3 people, 4 towns, 4 rivers and 3 companies), each the subject of one document: `long` stays below that."""


@dataclass(frozen=True)
class QAItem:
    """One question over its documents, with what the tests check: where the evidence is."""

    split: str
    kind: str
    """"single" or "multi"."""
    question_type: str
    """A key of QUESTIONS."""
    entity: str
    """The question's subject (a person, town, river or company name)."""
    bridge: str | None
    """multi: the entity that links the two evidence documents; single: None."""
    question: str
    stem: str
    """The answer's first words, which open the assistant's turn ("Maren Holloway plays the")."""
    answers: tuple[str, ...]
    """Accepted forms; the first is the canonical one."""
    documents: tuple[Document, ...]
    evidence: tuple[int, ...]
    """Indices into `documents`: the answer's document (single), the two hops in order (multi)."""


@dataclass(frozen=True)
class _Question:
    kind: str
    question: str
    """A template with {entity}."""
    stem: str
    """The answer's first words, a template with {entity}: the assistant's turn starts with them."""
    ask: Callable[[World, random.Random], tuple[str, str | None, tuple[str, ...], list[Document]]]
    """-> entity, bridge, answers, evidence documents (drawn with the item's rng)."""


def _person(world: World, rng: random.Random):
    return rng.choice(world.people)


def _ask_person(attr: str) -> Callable:
    def ask(world: World, rng: random.Random):
        p = _person(world, rng)
        return p.name, None, (getattr(p, attr),), [person_document(rng, p)]
    return ask


def _ask_town(attr: str) -> Callable:
    def ask(world: World, rng: random.Random):
        t = world.town(_person(world, rng).birth_town)
        return t.name, None, _answer_forms(attr, getattr(t, attr)), [town_document(rng, t)]
    return ask


def _ask_company_product(world: World, rng: random.Random):
    c = world.company(_person(world, rng).employer)
    return c.name, None, (c.product,), [company_document(rng, c)]


def _ask_river_lake(world: World, rng: random.Random):
    r = world.river(world.town(_person(world, rng).birth_town).river)
    return f"the {r.name}", None, _answer_forms("lake", r.lake), [river_document(rng, r)]


def _ask_birth_town(attr: str) -> Callable:
    def ask(world: World, rng: random.Random):
        p = _person(world, rng)
        t = world.town(p.birth_town)
        return p.name, t.name, _answer_forms(attr, getattr(t, attr)), [person_document(rng, p), town_document(rng, t)]
    return ask


def _ask_employer(attr: str) -> Callable:
    def ask(world: World, rng: random.Random):
        p = _person(world, rng)
        c = world.company(p.employer)
        return (p.name, c.name, _answer_forms(attr, getattr(c, attr)),
                [person_document(rng, p), company_document(rng, c)])
    return ask


def _ask_town_lake(world: World, rng: random.Random):
    t = world.town(_person(world, rng).birth_town)
    r = world.river(t.river)
    return t.name, r.name, _answer_forms("lake", r.lake), [town_document(rng, t), river_document(rng, r)]


def _answer_forms(attr: str, value: str) -> tuple[str, ...]:
    """The value and the longer forms the documents use for it."""
    if attr == "river":
        return value, f"river {value}", f"{value} River"
    if attr == "lake":
        return value, f"Lake {value}"
    return (value,)


QUESTIONS: dict[str, _Question] = {
    "instrument": _Question("single", "Which instrument does {entity} play?", "{entity} plays the",
                            _ask_person("instrument")),
    "profession": _Question("single", "What is {entity}'s profession?", "{entity} works as",
                            _ask_person("profession")),
    "birth_town": _Question("single", "In which town was {entity} born?", "{entity} was born in",
                            _ask_person("birth_town")),
    "employer": _Question("single", "Which company does {entity} work for?", "{entity} works for",
                          _ask_person("employer")),
    "town_river": _Question("single", "On which river does {entity} lie?", "{entity} lies on the river",
                            _ask_town("river")),
    "town_specialty": _Question("single", "What is {entity} known for?", "{entity} is known for its",
                                _ask_town("specialty")),
    "company_product": _Question("single", "What does {entity} make?", "{entity} makes", _ask_company_product),
    "river_lake": _Question("single", "Into which lake does {entity} flow?", "{entity} flows into Lake",
                            _ask_river_lake),
    "birth_town_river": _Question("multi", "On which river lies the town where {entity} was born?",
                                  "The town where {entity} was born lies on the river", _ask_birth_town("river")),
    "birth_town_specialty": _Question("multi", "What is the town where {entity} was born known for?",
                                      "The town where {entity} was born is known for its",
                                      _ask_birth_town("specialty")),
    "employer_town": _Question("multi", "In which town is the company that {entity} works for based?",
                               "The company that {entity} works for is based in", _ask_employer("town")),
    "employer_product": _Question("multi", "What does the company that {entity} works for make?",
                                  "The company that {entity} works for makes", _ask_employer("product")),
    "town_lake": _Question("multi", "Into which lake flows the river that runs through {entity}?",
                           "The river that runs through {entity} flows into Lake", _ask_town_lake),
}


def _distractors(world: World, rng: random.Random, evidence: list[Document], count: int) -> list[Document]:
    """`count` documents about the world's other entities; the parallel chain of another person first
    (their own document, then their birth town's or employer's)."""
    taken = {d.title for d in evidence}
    others = [p for p in world.people if p.name not in taken]
    rng.shuffle(others)
    candidates: list[Document] = []
    for p in others:
        candidates.append(person_document(rng, p))
        link = (town_document(rng, world.town(p.birth_town)) if rng.random() < 0.5
                else company_document(rng, world.company(p.employer)))
        candidates.append(link)
    rest = ([town_document(rng, t) for t in world.towns] + [company_document(rng, c) for c in world.companies]
            + [river_document(rng, r) for r in world.rivers])
    rng.shuffle(rest)
    out = []
    for doc in candidates + rest:
        if doc.title not in taken and len(out) < count:
            taken.add(doc.title)
            out.append(doc)
    return out


def make_item(split: str, seed: int, index: int, layout: str = "short") -> QAItem:
    """Item `index` of `split` under `seed`: `multi` at odd indices, `single` at even ones; `layout` sets
    how many documents it retrieves (LAYOUTS), not what it asks."""
    min_docs, max_docs = LAYOUTS[layout]
    rng = random.Random(f"cachefuse-qa/{split}/{seed}/{index}")
    world = sample_world(rng, name_pools(split))
    kind = KINDS[index % 2]
    question_type = rng.choice(sorted(k for k, q in QUESTIONS.items() if q.kind == kind))
    spec = QUESTIONS[question_type]
    entity, bridge, answers, evidence = spec.ask(world, rng)
    num_docs = rng.randint(min_docs, max_docs)
    documents = evidence + _distractors(world, rng, evidence, num_docs - len(evidence))
    order = list(range(len(documents)))
    rng.shuffle(order)
    shuffled = tuple(documents[i] for i in order)
    positions = tuple(order.index(i) for i in range(len(evidence)))
    question, stem = (_capitalized(t.format(entity=entity)) for t in (spec.question, spec.stem))
    return QAItem(split, kind, question_type, entity, bridge, question, stem, answers, shuffled, positions)


def _capitalized(text: str) -> str:
    return text[0].upper() + text[1:]


def make_items(split: str, count: int, seed: int = 0, layout: str = "short") -> list[QAItem]:
    """Items 0..count-1 of `split` under `seed` (half single, half multi) in `layout` (LAYOUTS)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}, expected one of {', '.join(SPLITS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}, expected one of {', '.join(LAYOUTS)}")
    return [make_item(split, seed, i, layout) for i in range(count)]


def eval_items(items: list[QAItem], tokenizer: Any = None) -> list[EvalItem]:
    """The harness's items: in the tokenizer's chat template where it has one, else plain text
    (`SYSTEM_PROMPT` + a newline, the documents, the question and "Answer:"). The question piece
    ends with the answer's stem, so the prediction is the continuation that names the answer.

    NOTE: the stem is what makes a 135M model answer at all: asked bare, SmolLM2-135M-Instruct
    restates the question for the first 8 tokens (token F1 0.01 on 20 validation items under full
    prefill; 0.40 on 24 with the stem; a worked example in the system turn did worse, 0.19 on 12).
    """
    from cachefuse.eval.harness import EvalItem
    from cachefuse.rag_prompt import chat_pieces

    pieces = chat_pieces(tokenizer, SYSTEM_PROMPT) if tokenizer is not None else None
    system = pieces.system if pieces else SYSTEM_PROMPT + "\n"
    suffix = pieces.question_suffix if pieces else "\nAnswer: "
    return [EvalItem(system, tuple(d.text for d in item.documents),
                     QUESTION_TEMPLATE.format(question=item.question) + suffix + item.stem, item.answers, item.kind)
            for item in items]


def answer_evidence_rows(item: QAItem, eval_item: Any, tokenizer: Any) -> tuple[Any, tuple[int, ...]]:
    """The item's prompt (`build_rag_prompt` of its eval item) and the rows where an accepted answer is
    written in its documents (every occurrence, case-insensitive): QCFuse's gold answer positions, the
    labels `cachefuse profile-layers` measures recall on. A document whose ids differ when tokenized
    with offsets (a slow tokenizer) contributes no rows.
    """
    from cachefuse.rag_prompt import build_rag_prompt

    prompt = build_rag_prompt(tokenizer, eval_item.system, list(eval_item.chunks), eval_item.question)
    rows: set[int] = set()
    for (start, _), ids, text in zip(prompt.chunks[1:], prompt.chunk_token_ids[1:], eval_item.chunks, strict=True):
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(encoded["input_ids"]) != list(ids):
            continue
        spans = _occurrences(text, item.answers)
        for t, (a, b) in enumerate(encoded["offset_mapping"]):
            if any(a < end and start_ < b for start_, end in spans):
                rows.add(start + t)
    return prompt, tuple(sorted(rows))


def _occurrences(text: str, phrases: Sequence[str]) -> list[tuple[int, int]]:
    """[start, end) character spans of every occurrence of any phrase (case-insensitive)."""
    lowered, spans = text.lower(), []
    for phrase in {p.lower() for p in phrases if p.strip()}:
        at = lowered.find(phrase)
        while at >= 0:
            spans.append((at, at + len(phrase)))
            at = lowered.find(phrase, at + 1)
    return spans

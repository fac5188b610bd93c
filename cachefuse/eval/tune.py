"""Cache-Craft's alpha fitted on a validation set (Eq. 13): the lowest mean CFO that keeps quality.

    alpha* = argmin_alpha E[CFO_alpha]   subject to   quality_alpha >= floor

Imports torch, tqdm and cachefuse.{chunks, config, engine, errors, eval.fidelity, eval.harness, select}; never vllm.
Runs on the reference engine (FusionEngine over adapters.hf.HFAdapter), which `cachefuse tune-alpha`
builds over an in-memory store.

The store state is built once and is the same for every alpha:

1. Base variants: the system prompt alone, and each retrieved chunk after the system prompt (what
   `cachefuse precompute` stores).
2. Warm pass (`warm_variants`): each item once with its chunks in a seeded rotated order, every
   retrieved chunk a hole, with attention statistics on and holes saved. This stores fused variants
   with CCI and token rankings, as a deployment accumulates them, so the validation prompts (in
   their own order) choose among variants whose prefixes overlap theirs partly (beta, gamma).
3. Each alpha then runs every item with `selector="cachecraft"`, `cachecraft_alpha=alpha` (variant
   choice and CFO both use it), `save_holes=False` and no admission (`variant_admission_max_chunks=0`:
   every stored chunk is loaded at its CFO), so no run changes what the next one sees.

```
reference:  | system | chunk 1 | chunk 2 | chunk 3 | question |   full prefill (every row, every layer)
warm pass:  | system | chunk 2 (hole) | chunk 3 (hole) | chunk 1 (hole) | question |   saved with stats
per alpha:  | system | chunk 1 | chunk 2 | chunk 3 | question |   ceil(CFO * |C|) rows per chunk
```

NOTE: early termination (Algorithm 1) is off unless `TuneSpec.early_termination`: with it on,
unfocused chunks keep loaded K/V after the focus layer whatever alpha is, so quality stops rising
with alpha. A chunk whose variant's prefix lies inside its new prefix in the same order has beta' = 1,
hence CFO 0 at every alpha (chunks new to the prefix do not lower beta: cachefuse/metadata/scores.py, choice 6),
so with warm variants even a huge alpha need not reproduce the full prefill; with base variants only
(`warm_variants=False`) alpha >= 2 recomputes every loaded token but the first chunk's (exact context).
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cachefuse.config import CacheFuseConfig
from cachefuse.errors import ConfigError
from cachefuse.eval.fidelity import greedy_continuation, matching_prefix
from cachefuse.eval.harness import decode_text, store_base_variants
from cachefuse.eval.metrics import qa_f1_score
from cachefuse.fusion.engine import FusionEngine
from cachefuse.jsonl import read_jsonl
from cachefuse.rag_prompt import RagPrompt, build_rag_prompt
from cachefuse.select.base import Selector
from cachefuse.select.registry import make_selector

METRICS = ("match", "f1")


@dataclass(frozen=True)
class ValItem:
    """One validation prompt: `[system][chunk 1]...[chunk n][question]`, and its reference answer."""

    system: str
    chunks: tuple[str, ...]
    question: str
    answer: str | None = None


@dataclass(frozen=True)
class TuneSpec:
    """What to search and how to score it."""

    alphas: tuple[float, ...]
    """Candidate alphas, each in 0..100 (CacheFuseConfig.cachecraft_alpha's range); sorted, deduplicated."""
    floor: float
    """The quality an alpha must reach to be feasible, in 0..1."""
    metric: str = "match"
    """"match": greedy tokens equal to the full prefill's before the first divergence, / max_new_tokens;
    "f1": LongBench's token F1 of the decoded greedy continuation against the item's answer."""
    max_new_tokens: int = 8
    warm_variants: bool = True
    """Run the warm pass (module docstring) before tuning; False: base variants only."""
    early_termination: bool = False
    """cachecraft_early_termination while tuning (off: every chunk recomputes its CFO share in every layer)."""
    seed: int = 0
    """Seed of the warm pass's rotations."""

    def __post_init__(self) -> None:
        alphas = tuple(sorted(set(self.alphas)))
        if not alphas or not all(isinstance(a, int | float) and math.isfinite(a) and 0 <= a <= 100 for a in alphas):
            raise ConfigError(f"alphas={self.alphas!r}, expected one or more numbers in 0..100")
        object.__setattr__(self, "alphas", tuple(float(a) for a in alphas))
        if not (isinstance(self.floor, int | float) and 0.0 <= self.floor <= 1.0):
            raise ConfigError(f"floor={self.floor!r}, expected a number in 0..1")
        if self.metric not in METRICS:
            raise ConfigError(f"metric={self.metric!r}, expected one of {', '.join(METRICS)}")
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ConfigError(f"max_new_tokens={self.max_new_tokens!r}, expected an integer >= 1")


@dataclass(frozen=True)
class AlphaRow:
    alpha: float
    mean_cfo: float
    """Mean CFO over the loaded non-system chunks of every item (0.0 when none was loaded)."""
    recompute_fraction: float
    """Selected rows / candidate rows, summed over items."""
    quality: float


@dataclass(frozen=True)
class TuneReport:
    rows: tuple[AlphaRow, ...]
    """One per alpha, in increasing alpha."""
    alpha: float | None
    """alpha*: the feasible alpha with the lowest mean CFO (ties: the smaller); None when none is feasible."""
    floor: float
    metric: str
    num_items: int
    reference_quality: float
    """The full prefill's quality (1.0 for "match"; its F1 for "f1"): what a floor can hope for."""
    max_new_tokens: int
    warm_variants: bool
    early_termination: bool

    @property
    def best(self) -> AlphaRow:
        """The row of highest quality (ties: the lower mean CFO, then the smaller alpha)."""
        return min(self.rows, key=lambda r: (-r.quality, r.mean_cfo, r.alpha))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["rows"] = [asdict(r) for r in self.rows]
        data["best_quality"], data["best_alpha"] = self.best.quality, self.best.alpha
        return data


# --------------------------------------------------------------------------- data


def read_items_jsonl(path: str | Path) -> list[ValItem]:
    """Reads validation items, one JSON object per line; blank lines are skipped, other keys ignored.

    Each line: `{"system": str, "chunks": [str, ...], "question": str, "answer": str}` ("answer"
    optional; "system" and "question" may be empty strings; "chunks" is a non-empty list of non-empty
    strings).

    Raises:
        ValueError: the file cannot be read, or a line is bad; the message names the file, line and field.
    """
    items = [parse_item(record, where) for where, _, record in read_jsonl(path, "--data")]
    if not items:
        raise ValueError(f"--data {str(path)!r}: no items (expected one JSON object per line)")
    return items


def parse_item(record: Any, where: str) -> ValItem:
    """One parsed JSONL line as a ValItem; errors start with `where` and name the field."""
    if not isinstance(record, dict):
        raise ValueError(f'{where}: expected an object {{"system": ..., "chunks": [...], "question": ...}}, '
                         f"got {type(record).__name__}")
    for name in ("system", "question"):
        if not isinstance(record.get(name), str):
            raise ValueError(f'{where}: field "{name}": expected a string, got {record.get(name)!r}')
    chunks = record.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise ValueError(f'{where}: field "chunks": expected a non-empty list of strings, got {chunks!r}')
    for i, text in enumerate(chunks):
        if not isinstance(text, str) or not text:
            raise ValueError(f'{where}: field "chunks"[{i}]: expected a non-empty string, got {text!r}')
    answer = record.get("answer")
    if answer is not None and not isinstance(answer, str):
        raise ValueError(f'{where}: field "answer": expected a string, got {answer!r}')
    return ValItem(record["system"], tuple(chunks), record["question"], answer)


def check_items(items: Sequence[ValItem], metric: str) -> None:
    """Raises ValueError when `metric` needs answers that an item lacks (naming the item)."""
    if not items:
        raise ValueError("no validation items")
    if metric == "f1":
        for i, item in enumerate(items):
            if item.answer is None:
                raise ValueError(f'item {i}: field "answer" is missing; metric f1 needs an answer per item')


def build_prompts(tokenizer: Any, items: Sequence[ValItem]) -> list[RagPrompt]:
    """Each item's prompt (cachefuse.rag_prompt.build_rag_prompt); ValueError names the item."""
    prompts = []
    for i, item in enumerate(items):
        try:
            prompts.append(build_rag_prompt(tokenizer, item.system, item.chunks, item.question))
        except ValueError as exc:
            raise ValueError(f"item {i}: {exc}") from None
    return prompts


# --------------------------------------------------------------------------- metrics


def choose_alpha(rows: Sequence[AlphaRow], floor: float) -> float | None:
    """Eq. 13 over the measured rows: among rows with quality >= floor, the lowest mean CFO (ties: the
    smaller alpha); None when no row reaches the floor."""
    feasible = [r for r in rows if r.quality >= floor]
    return min(feasible, key=lambda r: (r.mean_cfo, r.alpha)).alpha if feasible else None


# --------------------------------------------------------------------------- tuning


def tune_alpha(engine: FusionEngine, tokenizer: Any, items: Sequence[ValItem], spec: TuneSpec, *,
               progress: bool = True) -> TuneReport:
    """Measures mean CFO, recompute fraction and quality per alpha, and picks alpha* (Eq. 13).

    Args:
        engine: a reference engine over an HFAdapter; its store and metadata gain the base and warm
            variants (use a scratch store). Its config is restored on return.
        tokenizer: the model's tokenizer (`encode`, `decode`, `bos_token_id`, `eos_token_id`).
        items: the validation set.
        spec: alphas, floor, metric and the run's settings.
        progress: show a tqdm progress bar (stderr), one step per prefill.

    Returns:
        The per-alpha rows and the chosen alpha.

    Raises:
        ValueError: an item lacks the answer metric "f1" needs, or tokenizes to an empty chunk.
    """
    from tqdm.auto import tqdm

    check_items(items, spec.metric)
    prompts = build_prompts(tokenizer, items)
    base = engine.config
    steps = len(items) * (2 + len(spec.alphas) + int(spec.warm_variants))
    with tqdm(total=steps, unit="prefill", desc="tune-alpha", disable=not progress) as bar:
        with _configured(engine, base.replace(collect_attention_stats=False)):
            full = []
            for prompt in prompts:
                store_base_variants(engine, prompt)
                full.append(_continuation(engine, prompt, "full_prefill", spec.max_new_tokens,
                                          variants=[None] * len(prompt.chunks)))  # every chunk computed
                bar.update(2)
        if spec.warm_variants:
            with _configured(engine, base.replace(collect_attention_stats=True)):
                _warm(engine, tokenizer, items, spec.seed, bar)
        rows = []
        for alpha in spec.alphas:
            config = base.replace(selector="cachecraft", cachecraft_alpha=alpha, force_cfo=None,
                                  cachecraft_early_termination=spec.early_termination,
                                  collect_attention_stats=False,
                                  variant_admission_max_chunks=0)  # every alpha sees the same variants
            with _configured(engine, config):
                rows.append(_run_alpha(engine, tokenizer, items, prompts, full, spec, bar))
    reference = 1.0 if spec.metric == "match" else _quality(tokenizer, items, full, full, spec)
    return TuneReport(rows=tuple(rows), alpha=choose_alpha(rows, spec.floor), floor=spec.floor, metric=spec.metric,
                      num_items=len(items), reference_quality=reference, max_new_tokens=spec.max_new_tokens,
                      warm_variants=spec.warm_variants, early_termination=spec.early_termination)


@contextlib.contextmanager
def _configured(engine: FusionEngine, config: CacheFuseConfig) -> Iterator[None]:
    """`engine` runs under `config` for the block (the engine reads its config on every pass)."""
    saved, engine.config = engine.config, config
    try:
        yield
    finally:
        engine.config = saved


def _warm(engine: FusionEngine, tokenizer: Any, items: Sequence[ValItem], seed: int, bar: Any) -> None:
    """Each item once, its chunks rotated by a seeded non-zero shift, every retrieved chunk a hole
    (saved as the variant for its rotated prefix, with statistics)."""
    rng = random.Random(seed)
    for item in items:
        shift = rng.randrange(1, len(item.chunks)) if len(item.chunks) > 1 else 0
        prompt = build_rag_prompt(tokenizer, item.system, item.chunks[shift:] + item.chunks[:shift], item.question)
        choices = engine.plan_variants(prompt.token_ids, prompt.chunks)
        choices = [c if start == 0 else None for (start, _), c in zip(prompt.chunks, choices, strict=True)]
        engine.prefill(prompt.token_ids, prompt.chunks, selector="full_reuse", save_holes=True, variants=choices)
        bar.update(1)


@dataclass(frozen=True)
class _Run:
    """One item's fused prefill under one setting: what the report needs from it."""

    tokens: list[int]
    """The greedy continuation, [max_new_tokens]."""
    chunk_cfo: list[float | None]
    num_selected: int
    num_candidates: int


def _continuation(engine: FusionEngine, prompt: RagPrompt, selector: str | Selector, max_new_tokens: int,
                  variants: list | None = None) -> _Run:
    """One prefill (no holes saved) and the greedy tokens decoded on its K/V."""
    result, stats = engine.prefill(prompt.token_ids, prompt.chunks, selector=selector, save_holes=False,
                                   variants=variants)
    return _Run(greedy_continuation(engine.adapter, result, max_new_tokens), stats.chunk_cfo,
                result.num_selected, result.num_candidates)


def _run_alpha(engine: FusionEngine, tokenizer: Any, items: Sequence[ValItem], prompts: Sequence[RagPrompt],
               full: Sequence[_Run], spec: TuneSpec, bar: Any) -> AlphaRow:
    """Every item under the engine's (cachecraft) config: its row of the report."""
    runs = []
    for prompt in prompts:
        runs.append(_continuation(engine, prompt, make_selector("cachecraft", engine.config), spec.max_new_tokens))
        bar.update(1)
    cfos = [cfo for prompt, run in zip(prompts, runs, strict=True)
            for (start, _), cfo in zip(prompt.chunks, run.chunk_cfo, strict=True)
            if start != 0 and cfo is not None]  # loaded retrieved chunks (offset 0: the system chunk)
    selected, candidates = sum(r.num_selected for r in runs), sum(r.num_candidates for r in runs)
    return AlphaRow(alpha=engine.config.cachecraft_alpha, mean_cfo=sum(cfos) / len(cfos) if cfos else 0.0,
                    recompute_fraction=selected / candidates if candidates else 0.0,
                    quality=_quality(tokenizer, items, runs, full, spec))


def _quality(tokenizer: Any, items: Sequence[ValItem], runs: Sequence[_Run], full: Sequence[_Run],
             spec: TuneSpec) -> float:
    """Mean over items of the spec's metric."""
    if spec.metric == "match":
        matched = sum(matching_prefix(a.tokens, b.tokens) for a, b in zip(runs, full, strict=True))
        return matched / (len(items) * spec.max_new_tokens)
    scores = [qa_f1_score(decode_text(tokenizer, run.tokens), item.answer or "")
              for run, item in zip(runs, items, strict=True)]
    return sum(scores) / len(scores)


def format_report(report: TuneReport) -> str:
    """The report as a table, alpha* and the config line to use."""
    lines = [f"cachefuse tune-alpha: {report.num_items} items, metric {report.metric} over {report.max_new_tokens} "
             f"new tokens (full prefill: {report.reference_quality:.3f}), floor {report.floor:g}, "
             f"warm variants {'on' if report.warm_variants else 'off'}, "
             f"early termination {'on' if report.early_termination else 'off'}",
             f"  {'alpha':>8}  {'mean CFO':>8}  {'recomputed':>10}  {'quality':>7}"]
    for row in report.rows:
        mark = "  <- alpha*" if row.alpha == report.alpha else ""
        lines.append(f"  {row.alpha:>8g}  {row.mean_cfo:>8.3f}  {row.recompute_fraction:>10.3f}  "
                     f"{row.quality:>7.3f}{mark}")
    if report.alpha is None:
        best = report.best
        lines.append(f"alpha* = none: no alpha reached quality {report.floor:g} "
                     f"(best {best.quality:.3f} at alpha {best.alpha:g})")
    else:
        lines += [f"alpha* = {report.alpha:g}", f"config: cachecraft_alpha: {report.alpha:g}"]
    return "\n".join(lines)

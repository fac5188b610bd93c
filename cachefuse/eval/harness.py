"""`cachefuse eval`: task score and fidelity of fused prefills, per selector and recompute ratio.

Imports torch, tqdm and cachefuse.{chunks, engine, eval.*, select}; never vllm. Runs on the reference
engine (FusionEngine over adapters.hf.HFAdapter, an in-memory store) and compares, on the same
prompts:

- `full_prefill`: every row of every layer computed (the reference);
- `full_reuse`: every stored chunk loaded as is (ratio 0, no full layers);
- each selector at each ratio, every chunk loaded from its base variant (the chunk computed after the
  system prompt, what `cachefuse precompute` stores).

Per setting it reports the task score (exact match, LongBench token F1 or ROUGE-L, the best over the
item's answers) by item kind, the normalized score (S - S_full_reuse) / (S_full_prefill - S_full_reuse)
when that gap exceeds twice its standard error, paired comparisons with full prefill and with
`cacheblend` at the same ratio (cachefuse.eval.stats), and fidelity to the full prefill: per-layer K/V
deviation, the question's last-token attention deviation per layer (total variation distance, mean
over heads; the report marks the selector's check layers), KL(full || fused) of the last-token distribution, top-1 agreement, and how many greedy
tokens match the full prefill's.

NOTE: `cachecraft` runs with `force_cfo` set to the ratio, so that its ratio axis means what it means
for the others: ceil(ratio * |C|) rows per chunk from the variant's ranking (base variants carry no
statistics, so their ranking is the chunk's first tokens; docs/variants.md).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cachefuse.config import CacheFuseConfig
from cachefuse.eval.fidelity import greedy_continuation, kv_deviation_per_layer, logits_kl, matching_prefix
from cachefuse.eval.metrics import best_score, normalize_answer, qa_f1_score, rouge_l_score
from cachefuse.fusion.engine import FusionEngine
from cachefuse.fusion.plan import FuseResult
from cachefuse.offline.anchors import anchor_annotator, kvzip_repeat_ids
from cachefuse.rag_prompt import RagPrompt, build_rag_prompt
from cachefuse.select.base import Selector
from cachefuse.select.registry import make_selector

BASELINES = ("full_prefill", "full_reuse")
DEFAULT_SELECTORS = ("cacheblend", "epic", "cachecraft", "random")
DEFAULT_RATIOS = (0.0, 0.05, 0.10, 0.15, 0.20, 0.30, 0.50, 1.0)


def exact_match(prediction: str, answer: str) -> float:
    """1.0 when the normalised prediction equals the normalised answer (LongBench's normalisation)."""
    return float(normalize_answer(prediction) == normalize_answer(answer))


METRICS: dict[str, Callable[[str, str], float]] = {"em": exact_match, "f1": qa_f1_score, "rouge_l": rouge_l_score}


@dataclass(frozen=True)
class EvalItem:
    """One prompt `[system][chunks][question]` and its reference answers."""

    system: str
    chunks: tuple[str, ...]
    question: str
    answers: tuple[str, ...]
    kind: str = "all"
    """A label to break scores down by (the probe's same_chunk / cross_chunk)."""


def probe_eval_items(seed: int, count: int) -> list[EvalItem]:
    """`count` items of the RAG probe task (cachefuse.eval.probe_task.make_items), kinds kept."""
    from cachefuse.eval.probe_task import make_items

    return [EvalItem(i.system, i.chunks, i.question, (i.answer,), i.kind) for i in make_items(seed, count)]


@dataclass(frozen=True)
class EvalSpec:
    selectors: tuple[str, ...] = DEFAULT_SELECTORS
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    metric: str = "em"
    max_new_tokens: int = 1
    anchor_ranking: str | None = None
    """QCFuse's anchors stored offline with each chunk ("key_norm", "attention" or "kvzip",
    cachefuse.offline.anchors); None: none stored, the selector derives key-norm anchors per request."""
    only: frozenset[tuple[str, float]] | None = None
    """The (selector, ratio) pairs of selectors x ratios to run (the baselines always run); None: all, so a
    grid that is not a full product, or the settings an earlier run lacks, cost no more than they are."""

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"metric={self.metric!r}, expected one of {', '.join(METRICS)}")
        for name in self.selectors:
            if name in BASELINES:
                raise ValueError(f"selector {name!r} is a baseline, always run; list only selectors to compare")
        if not all(0.0 <= r <= 1.0 for r in self.ratios):
            raise ValueError(f"ratios={self.ratios!r}, expected numbers in 0..1")

    def settings(self) -> list[tuple[str, float]]:
        return [(name, 1.0) if name == "full_prefill" else (name, 0.0) for name in BASELINES] + [
            (name, ratio) for name in self.selectors for ratio in self.ratios
            if self.only is None or (name, ratio) in self.only]


def setting_name(selector: str, ratio: float) -> str:
    return selector if selector in BASELINES else f"{selector}@{ratio:g}"


@dataclass
class ItemRun:
    """One item under one setting."""

    score: float
    prediction: str
    kl: float | None
    """KL(full || fused) of the last-token distribution (None through vLLM: it returns top logprobs only)."""
    top1_agree: bool
    greedy_match: float
    kv_deviation: list[float]
    """Per layer (empty through vLLM)."""
    attention_deviation: list[float]
    """Per layer, the last token's attention's total variation distance to full prefill's (mean over heads)."""
    recompute_fraction: float
    logprob_deviation: float | None = None
    """Through vLLM: the largest |difference| of the first token's top-20 logprobs to the reference's."""


@dataclass
class EvalRuns:
    """Every item's run under every setting: what the report is computed from."""

    items: list[EvalItem]
    spec: EvalSpec
    runs: dict[str, list[ItemRun]] = field(default_factory=dict)
    check_layers: dict[str, list[int]] = field(default_factory=dict)
    """Per setting, the layers at which its selector chooses rows (none for the baselines)."""


# --------------------------------------------------------------------------- running


def reference_engine(model_dir: str | Path, config: CacheFuseConfig) -> tuple[FusionEngine, Any]:
    """The reference engine over a local checkpoint (an unbounded in-memory store) and its tokenizer.

    Raises:
        ValueError / OSError: the directory holds no loadable checkpoint.
    """
    from transformers import AutoTokenizer

    from cachefuse.adapters.hf import HFAdapter
    from cachefuse.chunks import KeyContext, model_fingerprint
    from cachefuse.store.base import StoreIdentity
    from cachefuse.store.memory import MemoryStore

    fingerprint = model_fingerprint(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    adapter = HFAdapter.from_pretrained(str(model_dir))
    dtype = adapter.shape.dtype
    store = MemoryStore(StoreIdentity(fingerprint, adapter.shape.num_layers, dtype), capacity_bytes=sys.maxsize)
    key_context = KeyContext(fingerprint, str(dtype).removeprefix("torch."), config_hash=config.compute_hash())
    return FusionEngine(adapter, store, key_context, config), tokenizer



def store_base_variants(engine: FusionEngine, prompt: RagPrompt, anchor_ranking: str | None = None,
                        repeat_ids: Sequence[int] = ()) -> None:
    """The system chunk alone; each retrieved chunk after everything before the first retrieved one
    (the system prompt, or BOS when there is none): what `cachefuse precompute` stores. With
    `anchor_ranking`, each retrieved chunk carries QCFuse's anchors chosen that way ("kvzip" asks the
    model to repeat the chunk with `repeat_ids`, cachefuse.offline.anchors.kvzip_repeat_ids)."""
    retrieved = [(start, ids) for (start, _), ids in zip(prompt.chunks, prompt.chunk_token_ids, strict=True)
                 if start != 0]  # a chunk at offset 0 is the system chunk (cachefuse.chunks.segment_prompt)
    if prompt.chunks[0][0] == 0:
        engine.precompute([prompt.chunk_token_ids[0]])
    if retrieved:
        prefix = prompt.token_ids[:retrieved[0][0]]
        annotate = None
        if anchor_ranking is not None:
            config = engine.config
            annotate = anchor_annotator(engine.adapter, prefix, anchor_ranking, config.qcfuse_anchor_ratio,
                                        config.qcfuse_sink_tokens, repeat_ids)
        engine.precompute([ids for _, ids in retrieved], prefix_ids=prefix, annotate=annotate)


@torch.inference_mode()
def last_token_attention(engine: FusionEngine, result: FuseResult, last_token_id: int,
                         layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """The last prompt token's attention [num_heads, num_tokens] at `layers`, recomputed by the
    transformers model (eager attention) over the result's K/V of the other tokens: what the fused
    pass's last row attended to (the last row is computed in every layer by every selector)."""
    from transformers import DynamicCache

    model = engine.adapter.model
    cache = DynamicCache(ddp_cache_data=[
        (k[:-1].transpose(0, 1)[None].contiguous(), v[:-1].transpose(0, 1)[None].contiguous())
        for k, v in zip(result.k, result.v, strict=True)])
    position = result.k[0].shape[0] - 1
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(torch.tensor([[last_token_id]]), position_ids=torch.tensor([[position]]),
                    past_key_values=cache, use_cache=True, output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    return {layer: out.attentions[layer][0, :, -1].float() for layer in layers}


def fresh_store(engine: FusionEngine) -> None:
    """An empty store and metadata for the next item: items stay independent, and a variant budget
    (max_variants) can never evict one item's base variants to admit another's (a miss would turn a
    reuse setting into a partial prefill)."""
    from cachefuse.metadata.sqlite import SqliteMetaStore
    from cachefuse.store.memory import MemoryStore

    engine.store = MemoryStore(engine.store.identity, capacity_bytes=sys.maxsize)
    engine.metastore = SqliteMetaStore(":memory:", max_variants=engine.config.max_variants,
                                       policy=engine.config.eviction_policy)


SELECTOR_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qclast": ("qcfuse", {"qcfuse_layers": "last", "qcfuse_view": "question_only"}),
    "qcall": ("qcfuse", {"qcfuse_layers": "all", "qcfuse_view": "full"}),
    "prophetkv": ("qcfuse", {"qcfuse_layers": "all", "qcfuse_view": "full"}),
    "qcfuse_last": ("qcfuse", {"qcfuse_layers": "last"}),
    "qcfuse_all": ("qcfuse", {"qcfuse_layers": "all"}),
}
"""Setting names that are a selector under other config fields (QCFuse's baselines and ablations): name ->
(selector, fields). QCLast and QCAll are the QCFuse demo's context-free baselines: a query-only probe
scored at the last layer (its FusionRAG) and the question over every loaded row scored at every layer
(its ProphetKV; `prophetkv` is the same setting under the full paper's name). qcfuse_last / qcfuse_all
keep QCFuse's anchor view and change only the score layers (the full paper's layer ablation)."""


def selector_at(engine: FusionEngine, name: str, ratio: float) -> Selector:
    """The selector `name` as a setting at `ratio` runs it: cachecraft's ratio axis is `force_cfo`;
    a SELECTOR_VARIANTS name is its selector under its config fields."""
    if name in SELECTOR_VARIANTS:
        base, fields = SELECTOR_VARIANTS[name]
        return make_selector(base, engine.config.replace(**fields))
    config = engine.config.replace(force_cfo=ratio) if name == "cachecraft" else engine.config
    return make_selector(name, config)


@dataclass
class Reference:
    """The full prefill's output on one prompt, what every other setting is measured against."""

    result: FuseResult
    tokens: list[int]
    attention: dict[int, torch.Tensor]


def measure_run(engine: FusionEngine, tokenizer: Any, item: EvalItem, spec: EvalSpec, prompt: RagPrompt,
                result: FuseResult, reference: Reference | None = None) -> tuple[ItemRun, Reference]:
    """One fused prefill's ItemRun against `reference` (None: `result` is the full prefill itself), and
    the reference used. The recompute fraction is the selector's: selected rows / candidate rows."""
    layers = range(engine.adapter.shape.num_layers)
    tokens = greedy_continuation(engine.adapter, result, spec.max_new_tokens)
    attention = last_token_attention(engine, result, prompt.token_ids[-1], layers)
    if reference is None:
        reference = Reference(result, tokens, attention)
    prediction = decode_text(tokenizer, tokens)
    run = ItemRun(
        score=best_score(METRICS[spec.metric], prediction, item.answers), prediction=prediction,
        kl=max(0.0, logits_kl(reference.result.logits, result.logits)),
        top1_agree=bool(reference.result.logits.argmax() == result.logits.argmax()),
        greedy_match=matching_prefix(tokens, reference.tokens) / spec.max_new_tokens,
        kv_deviation=kv_deviation_per_layer(result, reference.result),
        attention_deviation=[float(0.5 * (attention[layer] - reference.attention[layer]).abs().sum(-1).mean())
                             for layer in layers],
        recompute_fraction=result.num_selected / result.num_candidates if result.num_candidates else 1.0)
    return run, reference


def full_prefill(engine: FusionEngine, prompt: RagPrompt) -> FuseResult:
    """Every row of every layer computed: the reference (no chunk loaded, nothing saved)."""
    result, _ = engine.prefill(prompt.token_ids, prompt.chunks, selector="full_prefill", ratio=1.0,
                               save_holes=False, variants=[None] * len(prompt.chunks))
    return result


def run_item(engine: FusionEngine, tokenizer: Any, item: EvalItem, spec: EvalSpec,
             on_setting: Callable[[], None] = lambda: None, keep_store: bool = False) -> dict[str, ItemRun]:
    """Every setting on one item (the item's base variants are stored first, in an empty store unless
    `keep_store`: then in the engine's store as it is, e.g. filled by an offline step for every item)."""
    prompt = build_rag_prompt(tokenizer, item.system, item.chunks, item.question)
    if not keep_store:
        fresh_store(engine)
    repeat_ids = kvzip_repeat_ids(tokenizer) if spec.anchor_ranking == "kvzip" else ()
    store_base_variants(engine, prompt, spec.anchor_ranking, repeat_ids)
    reference = None
    out = {}
    for name, ratio in spec.settings():
        if name == "full_prefill":
            result = full_prefill(engine, prompt)
        else:
            result, stats = engine.prefill(prompt.token_ids, prompt.chunks,
                                           selector=selector_at(engine, name, ratio), ratio=ratio, save_holes=False)
            if stats.chunks_missed:
                raise RuntimeError(f"{setting_name(name, ratio)}: {stats.chunks_missed} declared chunk(s) were not "
                                   f"loaded ({stats.miss_reasons}); the setting would not be measured as stated")
        out[setting_name(name, ratio)], reference = measure_run(engine, tokenizer, item, spec, prompt, result,
                                                                reference)
        on_setting()
    return out


def run_eval(engine: FusionEngine, tokenizer: Any, items: Sequence[EvalItem], spec: EvalSpec, *,
             progress: bool = True, desc: str = "cachefuse eval", keep_store: bool = False) -> EvalRuns:
    """Runs every setting on every item; a tqdm bar (stderr) counts prefills. `keep_store`: the items share
    the engine's store (see run_item) instead of each starting from an empty one."""
    from tqdm.auto import tqdm

    if not items:
        raise ValueError("no items to evaluate")
    num_layers = engine.adapter.shape.num_layers
    runs = EvalRuns(list(items), spec, {setting_name(n, r): [] for n, r in spec.settings()},
                    {setting_name(n, r): list(selector_at(engine, n, r).check_layers(num_layers))
                     for n, r in spec.settings()})
    with tqdm(total=len(items) * len(spec.settings()), unit="prefill", desc=desc, disable=not progress) as bar:
        for item in items:
            for name, run in run_item(engine, tokenizer, item, spec, lambda: bar.update(1), keep_store).items():
                runs.runs[name].append(run)
    return runs


def decode_text(tokenizer: Any, tokens: list[int]) -> str:
    """The continuation's text up to its first end-of-sequence token."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos in tokens:
        tokens = tokens[:tokens.index(eos)]
    return tokenizer.decode(tokens, skip_special_tokens=True)


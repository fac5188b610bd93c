"""First tokens before the next cohort's blend, under vLLM's own scheduler.

Requests sent together whose blends do not fit one step's budget (`blend_step_tokens`) run as cohorts,
one after another, split across steps, as asynchronous loads: vLLM schedules a request's first token in
the step after its blend ends, and that step's tokens are sampled after its blend work. The worker holds
the waiting blends in such a step (`CacheFuseMetadata.first_tokens`), so a cohort's first tokens never
wait for the next cohort's blend. Negative control: with the scheduler's count forced to 0, the next
cohort's blend runs in the step that samples the first tokens.
"""

from __future__ import annotations

import pytest

from cachefuse.vllm.scheduler_side.planning import Planner
from cachefuse.vllm.worker_side import WorkerSide
from tests.helpers import vllm_engines as engines

BUDGET_TOKENS = 48  # a few layers of one request per step: every blend is split, each request its own cohort
ORDERS = [("system", "a", "b", "c", "question"), ("system", "c", "a", "b", "question"),
          ("system", "b", "c", "a", "question")]


@pytest.fixture(scope="module")
def family():  # the scheduling path is model-independent
    return "llama"


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("first-tokens-store")
    llm = engines.start_engine(tiny_model_dir("llama"), store, blend_step_tokens=BUDGET_TOKENS)
    pieces = engines.random_pieces(11, {"system": 20, "a": 60, "b": 50, "c": 40, "question": 10})
    engines.precompute(llm, pieces["system"], [pieces[name] for name in "abc"])
    yield llm, pieces
    engines.stop_engine(llm)


def _run_recording_steps(llm, pieces, monkeypatch, counted: bool):
    """Sends the three prompts together; per engine step: (first tokens due, blends waiting before it,
    whether the waiting blends advanced). `counted` False: the scheduler reports no first tokens."""
    steps = []
    real_count, real_start, real_advance = Planner.first_tokens, WorkerSide.start_load_kv, WorkerSide._advance

    def count(self, scheduler_output):
        due = real_count(self, scheduler_output)
        steps.append({"due": due, "waiting": 0, "advanced": False})
        return due if counted else 0

    def start(self, metadata, forward_context):
        steps[-1]["waiting"] = len(self.passes)
        return real_start(self, metadata, forward_context)

    def advance(self, batch, budget_rows):
        if batch is self.passes:
            steps[-1]["advanced"] = True
        return real_advance(self, batch, budget_rows)

    monkeypatch.setattr(Planner, "first_tokens", count)
    monkeypatch.setattr(WorkerSide, "start_load_kv", start)
    monkeypatch.setattr(WorkerSide, "_advance", advance)
    made = [engines.named_prompt(pieces, order) for order in ORDERS]
    outputs = engines.generate(llm, [ids for ids, _ in made], [p for _, p in made], max_tokens=2)
    monkeypatch.undo()
    return steps, outputs


def test_a_step_that_samples_first_tokens_holds_the_waiting_blends(setup, monkeypatch):
    llm, pieces = setup
    steps, outputs = _run_recording_steps(llm, pieces, monkeypatch, counted=True)
    assert all(out.kv_transfer_params["cachefuse"]["status"] == "fused" for out in outputs)
    assert all(out.kv_transfer_params["cachefuse"]["blend_steps"] > 1 for out in outputs)  # split, as cohorts
    held = [step for step in steps if step["due"] and step["waiting"]]
    assert held, steps  # a cohort's first tokens came while the next cohort waited
    assert not any(step["advanced"] for step in held), steps
    assert sum(step["due"] for step in steps) == len(ORDERS)  # each first token counted once


def test_negative_control_uncounted_first_tokens_wait_for_the_next_blend(setup, monkeypatch):
    llm, pieces = setup
    steps, outputs = _run_recording_steps(llm, pieces, monkeypatch, counted=False)
    assert all(out.kv_transfer_params["cachefuse"]["status"] == "fused" for out in outputs)
    assert any(step["due"] and step["waiting"] and step["advanced"] for step in steps), steps

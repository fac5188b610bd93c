"""A whole vLLM engine with CacheFuseConnector on vLLM's Triton attention backend (a GPU backend), on CPU.

vLLM's CPU platform always answers with its own attention backend; here it is made to take TRITON_ATTN,
whose kernels run interpreted (tests/helpers/vllm_triton.py). Everything else is the engine as served:
vLLM's scheduler allocates the blocks and slots, its model runner binds `TritonAttentionImpl` layers and
their caches, the connector's worker half meets a backend that is not the CPU one and takes
`SlotWritingAttention` (cachefuse.vllm.paged), whose cache-view probe proves the layout through the
layers' own writer, and vLLM then computes the last token and decodes with its own Triton attention over
the slots the blend pass wrote. This is the GPU path of the worker inside vLLM, short of the GPU.

The reference is the same fused request on an engine with vLLM's CPU backend (`PagedAttention`), over
the same store: same first-token logprobs within LOGPROB_TOL and the same greedy tokens; the plain
engines agree too. Negative control: full reuse on the Triton engine differs.
"""

from __future__ import annotations

import pytest

from cachefuse.vllm import paged
from cachefuse.vllm import worker_side as worker_module
from tests.helpers.tolerances import LOGPROB_TOL
from tests.helpers.vllm_engines import (
    first_logprobs,
    generate,
    max_logprob_diff,
    named_prompt,
    precompute,
    random_pieces,
    start_engine,
    stop_engine,
)
from tests.helpers.vllm_triton import vllm_triton_backend

pytestmark = pytest.mark.vllm
LENGTHS = {"system": 12, "a": 33, "b": 27, "c": 41, "question": 9}
ORDER = ["system", "c", "b", "a", "question"]
MAX_TOKENS = 3


def _recording(cls, built: list):
    """`cls` recording every instance the worker builds (it drops its backend after each pass)."""
    class Recording(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)
    Recording.__name__ = cls.__name__
    return Recording


def _fused(llm, pieces, **overrides):
    prompt, params = named_prompt(pieces, ORDER, **overrides)
    out = generate(llm, [prompt], [params], max_tokens=MAX_TOKENS)[0]
    assert out.kv_transfer_params["cachefuse"]["status"] == "fused", out.kv_transfer_params
    return first_logprobs(out), list(out.outputs[0].token_ids)


def _plain(llm, pieces):
    prompt, _ = named_prompt(pieces, ORDER)
    out = generate(llm, [prompt], [None], max_tokens=MAX_TOKENS)[0]
    return first_logprobs(out), list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """The CPU backend's and the Triton backend's answers to the same prompts over one store holding the
    system prompt, a and c (b stays a hole: neither engine saves)."""
    model, store = tiny_model_dir("llama"), tmp_path_factory.mktemp("triton-store")
    pieces = random_pieces(21, LENGTHS)
    writer = start_engine(model, store)
    precompute(writer, pieces["system"], [pieces["a"], pieces["c"]])
    stop_engine(writer)

    built = {"cpu": [], "triton": []}
    with pytest.MonkeyPatch.context() as patch:
        for name in ("PagedAttention", "SlotWritingAttention"):
            patch.setattr(worker_module, name, _recording(getattr(worker_module, name), built["cpu"]))
        cpu = start_engine(model, store, save_holes=False)
        answers = {"cpu": _fused(cpu, pieces, selector="cacheblend", recompute_ratio=0.15),
                   "cpu_plain": _plain(cpu, pieces)}
        stop_engine(cpu)
        for name in ("PagedAttention", "SlotWritingAttention"):
            patch.setattr(worker_module, name, _recording(getattr(paged, name), built["triton"]))
        for triton_attn in vllm_triton_backend(engines=True):  # noqa: B007 - returned below
            llm = start_engine(model, store, save_holes=False)
            try:
                layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context.values()
                impls = {type(layer.impl) for layer in layers}
                answers["triton"] = _fused(llm, pieces, selector="cacheblend", recompute_ratio=0.15)
                answers["triton_reuse"] = _fused(llm, pieces, selector="full_reuse")
                answers["triton_plain"] = _plain(llm, pieces)
            finally:
                stop_engine(llm)
    return answers, impls, built, triton_attn


def test_the_engine_ran_vllms_triton_backend_and_the_generic_worker_path(runs):
    _, impls, built, triton_attn = runs
    assert impls == {triton_attn.TritonAttentionImpl}
    assert [type(b).__name__ for b in built["cpu"]] == ["PagedAttention"]
    assert [type(b).__name__ for b in built["triton"]] == ["SlotWritingAttention"] * 2
    for backend in built["triton"]:
        assert backend.read_in_place and all(backend.read_in_place.values())  # rows read from vLLM's pages


def test_plain_engines_agree(runs):
    answers = runs[0]
    (cpu_lp, cpu_tokens), (tri_lp, tri_tokens) = answers["cpu_plain"], answers["triton_plain"]
    assert max_logprob_diff(cpu_lp, tri_lp) <= LOGPROB_TOL and tri_tokens == cpu_tokens


def test_fused_on_the_triton_backend_equals_the_cpu_backend(runs):
    answers = runs[0]
    (cpu_lp, cpu_tokens), (tri_lp, tri_tokens) = answers["cpu"], answers["triton"]
    assert max_logprob_diff(cpu_lp, tri_lp) <= LOGPROB_TOL
    assert tri_tokens == cpu_tokens


def test_negative_control_full_reuse_differs(runs):
    answers = runs[0]
    assert max_logprob_diff(answers["triton"][0], answers["triton_reuse"][0]) > 100 * LOGPROB_TOL

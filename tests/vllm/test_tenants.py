"""One tenant's request never changes another's answer: what a request saves is keyed by what it was
computed after, so only an entry computed at the prompt's start serves a system chunk (offset 0),
which is reused as exact, with no row recomputed.

Tenant 1 sends a document after a few undeclared tokens, with no chunk declared before it: its hole
is saved as the document's base variant. Tenant 2 then declares the same text at offset 0. Its answer
must be plain vLLM's (the system chunk is exact; everything else is computed in full here), where it
was 0.117 away in first-token logprob when tenant 1's entry was served as exact.
"""

from __future__ import annotations

import pytest

from tests.helpers import vllm_engines as engines
from tests.helpers.tolerances import LOGPROB_TOL


@pytest.fixture(scope="module")
def family():  # the keying is model-independent
    return "llama"


@pytest.fixture(scope="module")
def llm(tiny_model_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("tenant-store")
    engine = engines.start_engine(tiny_model_dir("llama"), store, selector="full_reuse")
    yield engine
    engines.stop_engine(engine)


def diff(expected, actual) -> float:
    return engines.max_logprob_diff(engines.first_logprobs(expected), engines.first_logprobs(actual))


def test_a_document_saved_by_one_tenant_is_not_another_tenants_exact_system_chunk(llm):
    pieces = engines.random_pieces(11, {"glue": 7, "doc": 40, "tail": 25, "question": 9})
    glue, doc = pieces["glue"], pieces["doc"]
    first_ids = glue + doc + pieces["question"]
    declared = {"cachefuse": {"chunks": [[len(glue), len(glue) + len(doc)]]}}
    (first,) = engines.generate(llm, [first_ids], [declared])
    assert first.kv_transfer_params["cachefuse"]["holes_saved"] == 1  # the document, computed after the glue

    second_ids = doc + pieces["tail"] + pieces["question"]
    params = {"cachefuse": {"chunks": [[0, len(doc)]]}}  # the same text, now the system chunk
    (fused,) = engines.generate(llm, [second_ids], [params])
    (plain,) = engines.generate(llm, [second_ids], [None])
    assert diff(plain, fused) < LOGPROB_TOL
    stats = fused.kv_transfer_params["cachefuse"]
    assert stats["status"] == "fused" and stats["chunks_hit"] == 0
    assert stats["miss_reasons"] == {"not_stored": 1}
    engine = engines.worker_side().engine
    assert engine.store.contains(engine.key(doc))  # tenant 1's entry is there, under another key

    # The system chunk is now stored as computed at the start: the next request reuses it, still exact.
    (again,) = engines.generate(llm, [second_ids], [params])
    assert again.kv_transfer_params["cachefuse"]["chunks_hit"] == 1
    assert diff(plain, again) < LOGPROB_TOL
    assert engines.scheduler_connector(llm).counters["fallback:blend_error"] == 0

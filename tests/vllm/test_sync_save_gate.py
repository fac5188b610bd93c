"""`sync_save` on a real engine: an API client of a server (the default config) may not ask for it, and
offline precompute refuses to start on such an engine rather than storing nothing.

`sync_save` makes the worker write a request's holes (fsync, metadata transaction, Redis) before the
step's forward, so every request of the batch waits on them. Engines that serve only the job that
built them (`cachefuse.vllm.engines.connector_extra_config`, the tests' `start_engine`) allow it;
tests/vllm/test_precompute.py is the control that precompute works on those.
"""

from __future__ import annotations

import pytest

from cachefuse.errors import ConfigError
from tests.helpers.vllm_engines import generate, named_prompt, random_pieces, start_engine, stop_engine


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("gated-store")
    llm = start_engine(model_dir, store, allow_sync_save=False)  # a server's default
    yield llm, store
    stop_engine(llm)


def test_a_client_asking_for_sync_save_gets_plain_vllm_and_the_reason(server):
    llm, _ = server
    pieces = random_pieces(3, {"system": 12, "a": 30, "question": 8})
    ids, params = named_prompt(pieces, ("system", "a", "question"), sync_save=True)
    fused, plain = generate(llm, [ids, ids], [params, None], max_tokens=4)
    stats = fused.kv_transfer_params["cachefuse"]
    assert stats["status"] == "fallback" and stats["fallback_reason"] == "malformed_request", stats
    assert stats["field"] == "cachefuse.sync_save" and "allow_sync_save" in stats["detail"]
    assert fused.outputs[0].token_ids == plain.outputs[0].token_ids
    del params["cachefuse"]["sync_save"]  # control: the same request without it is fused
    (output,) = generate(llm, [ids], [params], max_tokens=4)
    assert output.kv_transfer_params["cachefuse"]["status"] == "fused"


def test_precompute_refuses_an_engine_that_refuses_sync_save(server, tokenizer):
    from cachefuse.offline.precompute import precompute_chunks

    llm, store = server
    with pytest.raises(ConfigError, match="allow_sync_save"):
        precompute_chunks(llm, tokenizer, "System.\n", ["Document 1.\n"], store_dir=store, progress=False)

"""FusionEngine over a Redis K/V tier whose replies trickle in (a real redis-server behind
tests/helpers/trickling_proxy.py, the engine on the proxy's test clock): a read whose reply outlasts what
is left of `load_timeout_s` is cut mid-reply, its chunk computed in full with miss reason "load_timeout"
(serial and pipelined loading), and the answer is that of a store holding only what was read in time.
The control: with no load budget every trickled read is waited out and every chunk hits."""

from __future__ import annotations

import contextlib

import pytest
import torch

from cachefuse.config import CacheFuseConfig
from cachefuse.store.redis import RedisKVStore
from tests.helpers.fusion import make_case, make_engine, precompute_case
from tests.helpers.trickling_proxy import TestClock, TricklingProxy

STEP_S = 0.25  # per piece: an existence check (4 pieces) takes 1 s on the clock, an entry or layer (8) 2 s


@pytest.fixture(scope="module")
def case(adapter):
    return make_case(adapter.shape.vocab_size, seed=11)  # chunks: system, A, B, C; then the question


@pytest.mark.parametrize("depth", [0, 2])
def test_a_trickled_read_past_the_load_budget_is_cut_and_its_chunk_a_hole(adapter, case, redis_server,
                                                                          redis_namespace, depth):
    source = make_engine(adapter)
    precompute_case(source, case, with_hole=False)
    clock = TestClock()
    with TricklingProxy(redis_server.port, clock) as proxy, contextlib.ExitStack() as stack:
        store = stack.enter_context(contextlib.closing(RedisKVStore(
            proxy.url(), source.store.identity, timeout_s=2.0, namespace=redis_namespace, clock=clock)))
        for key in source.store.keys():
            assert store.put(key, source.store.get(key)) and store.get(key) is not None  # warm: script, connection
        engine = make_engine(adapter, CacheFuseConfig(preload_depth=depth, load_timeout_s=5.0))
        engine.store, engine.metastore, engine.clock = store, source.metastore, clock

        proxy.trickle(8, STEP_S, hold_s=10.0, hold_from=5.0)  # the blend's deadline: the clock moves only in its calls
        result, stats = engine.prefill(case.token_ids, case.chunks, save_holes=False)
        assert stats.miss_reasons.get("load_timeout", 0) >= 3 and stats.chunks_hit <= 1, stats.miss_reasons
        assert set(stats.miss_reasons) == {"load_timeout"}  # a cut read is the budget's, not an io_error
        assert proxy.cut_replies >= 1  # a reply was cut mid-way, not only calls left unsent

        proxy.forward()
        without = make_engine(adapter, CacheFuseConfig(preload_depth=0, load_timeout_s=None))
        for key in stats.loaded_keys:  # a store holding only what was read in time
            assert without.store.put(key, store.get(key))
        expected, _ = without.prefill(case.token_ids, case.chunks, save_holes=False)
        torch.testing.assert_close(result.logits, expected.logits, rtol=0, atol=1e-5)

        engine.config = CacheFuseConfig(preload_depth=depth, load_timeout_s=None)  # control: no budget
        proxy.trickle(8, STEP_S, hold_s=0.2)
        start = clock()
        _, unbounded = engine.prefill(case.token_ids, case.chunks, save_holes=False)
        assert unbounded.chunks_hit == len(case.chunks) and not unbounded.miss_reasons
        assert clock() - start > 5.0  # every read waited out, past what the budget allowed

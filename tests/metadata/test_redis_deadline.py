"""RedisMetaStore under a call deadline (a blend's load budget, cachefuse.call_deadline), against a real
redis-server behind a proxy that trickles replies (tests/helpers/trickling_proxy.py): the calls a blend
makes (pinning its variants, recording their reuse, reading rows) end by the deadline as a StoreError,
however their reply is spread over socket reads, and change nothing of this process's (no pin taken); a
deadline already passed sends nothing; without the deadline (the control) the same call outlasts it."""

from __future__ import annotations

import contextlib

import pytest

from cachefuse.call_deadline import calls_within
from cachefuse.errors import StoreError
from cachefuse.metadata.base import VariantRecord
from cachefuse.metadata.redis import RedisMetaStore
from tests.helpers.trickling_proxy import TestClock, TricklingProxy

TIMEOUT_S = 2.0  # the socket timeout (real seconds), longer than the proxy's pause in a control
BUDGET_S = 1.0  # on the test clock
PIECES, STEP_S = 8, 0.3  # every reply in 8 pieces (fewer when shorter, at least 4), 0.3 s each: past the budget
RECORD = VariantRecord(chunk_key="A", prefix=(), inter={}, intra=1.0, num_tokens=2)
CALLS = {  # the blend's calls (FusionEngine: pin, record reuses, rows of its chunks)
    "pin_many": lambda store: store.pin_many([RECORD.variant_id]),
    "record_uses": lambda store: store.record_uses([(RECORD.variant_id, 0.5)]),
    "get": lambda store: store.get(RECORD.variant_id),
    "variants": lambda store: store.variants("A"),
}


@pytest.fixture
def proxied(redis_server, redis_namespace):
    """(store through the proxy, proxy, clock); RECORD stored."""
    clock = TestClock()
    with TricklingProxy(redis_server.port, clock) as proxy:
        store = RedisMetaStore(proxy.url(), max_variants=8, timeout_s=TIMEOUT_S, namespace=redis_namespace)
        with contextlib.closing(store):
            store.put(RECORD)
            yield store, proxy, clock


@pytest.mark.parametrize("call", CALLS)
def test_a_blends_metadata_call_ends_by_the_deadline(proxied, call):
    store, proxy, clock = proxied
    assert CALLS[call](store)  # answers; the scripts are loaded and a connection pooled
    if call == "pin_many":
        store.unpin(RECORD.variant_id)
    proxy.trickle(PIECES, STEP_S, hold_s=10.0)
    with calls_within(BUDGET_S, clock) as deadline, pytest.raises(StoreError, match="redis metastore"):
        CALLS[call](store)
    assert deadline.cut and proxy.settled(1) and proxy.cut_replies == 1
    assert store.pin_count(RECORD.variant_id) == 0  # a cut pin is not taken
    proxy.forward()
    assert store.get(RECORD.variant_id).variant_id == RECORD.variant_id  # no half-read reply taken for this one

    proxy.trickle(PIECES, STEP_S, hold_s=0.2)  # control: no deadline, the call waits the reply out
    start = clock()
    assert CALLS[call](store)
    assert clock() - start > BUDGET_S and proxy.settled(2) and proxy.whole_replies == 1


def test_no_call_is_sent_once_the_deadline_has_passed(proxied):
    store, proxy, clock = proxied
    with calls_within(BUDGET_S, clock) as deadline:
        clock.advance(BUDGET_S)
        with pytest.raises(StoreError, match="deadline has passed"):
            store.pin_many([RECORD.variant_id])
    assert deadline.cut and proxy.cut_replies == proxy.whole_replies == 0
    assert store.pin_many([RECORD.variant_id]) == [RECORD.variant_id]  # the control: outside, it is sent

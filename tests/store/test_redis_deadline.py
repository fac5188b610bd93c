"""RedisKVStore under a call deadline (a blend's load budget, cachefuse.call_deadline), against a real
redis-server behind a proxy that trickles replies (tests/helpers/trickling_proxy.py): every read a blend
makes (whole entry, one layer, the probe's rows and metadata, the existence check) ends by the deadline
however its reply is spread, as an "io_error" miss that keeps the entry, drops its connection, and says
nothing of an outage; without the deadline (the control) the same read outlasts it and answers."""

from __future__ import annotations

import contextlib

import pytest
import torch

from cachefuse.call_deadline import calls_within
from cachefuse.store.redis import RedisKVStore
from tests.helpers.store import IDENTITY, make_entry
from tests.helpers.trickling_proxy import TestClock, TricklingProxy

KEY = "ab12cd"
TIMEOUT_S = 2.0  # the socket timeout (real seconds), longer than the proxy's pause in a control
BUDGET_S = 1.0  # on the test clock
PIECES, STEP_S = 8, 0.3  # every reply in 8 pieces (4 for the 4 bytes of ":1\r\n"), 0.3 s each: past the budget
READS = {
    "get": lambda store: store.get(KEY),
    "get_layer": lambda store: store.get_layer(KEY, 1),
    "get_rows": lambda store: store.get_rows(KEY, 2, torch.tensor([0, 4, 12])),
    "get_meta": lambda store: store.get_meta(KEY),
    "contains": lambda store: store.contains(KEY),
}


def _flat(answer) -> list:
    """An answer as a list of comparable parts (tensors compared with torch.equal)."""
    if hasattr(answer, "k_nope"):
        return [*answer.k_nope, *answer.v, answer.meta]
    return list(answer) if isinstance(answer, tuple) else [answer]


def _same(a, b) -> bool:
    return len(_flat(a)) == len(_flat(b)) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(_flat(a), _flat(b), strict=True))


@pytest.fixture
def proxied(redis_server, redis_namespace):
    """(store through the proxy, on the test clock; proxy; clock); the entry KEY stored."""
    clock = TestClock()
    with TricklingProxy(redis_server.port, clock) as proxy:
        store = RedisKVStore(proxy.url(), IDENTITY, timeout_s=TIMEOUT_S, namespace=redis_namespace, clock=clock)
        with contextlib.closing(store):
            assert store.put(KEY, make_entry(13, meta={"anchors": "0,4"}))
            yield store, proxy, clock


@pytest.mark.parametrize("read", READS)
def test_every_read_ends_by_the_deadline_as_a_miss_that_keeps_the_entry(proxied, read):
    store, proxy, clock = proxied
    expected = READS[read](store)  # the answer; the script is loaded and a connection pooled
    assert expected is not None and expected is not False
    for attempt in range(2):  # two cuts a whole socket timeout apart: two timeouts would start a backoff
        clock.advance(TIMEOUT_S * attempt)
        proxy.trickle(PIECES, STEP_S, hold_s=10.0)
        with calls_within(BUDGET_S, clock) as deadline:
            assert READS[read](store) in (None, False)
        assert deadline.cut and proxy.settled(attempt + 1) and proxy.cut_replies == attempt + 1
    assert not store._outage.blocked()  # a cut of ours is not the server's silence
    misses = dict(store.stats.misses)
    proxy.forward()
    assert _same(READS[read](store), expected)  # kept, and no half-read reply taken for this one's
    assert dict(store.stats.misses) == misses

    proxy.trickle(PIECES, STEP_S, hold_s=0.2)  # control: no deadline, the read waits the reply out
    start = clock()
    assert _same(READS[read](store), expected)
    assert clock() - start > BUDGET_S and proxy.settled(3) and proxy.whole_replies == 1


def test_no_read_is_sent_once_the_deadline_has_passed(proxied):
    store, proxy, clock = proxied
    with calls_within(BUDGET_S, clock) as deadline:
        clock.advance(BUDGET_S)
        assert store.get(KEY) is None and not store.contains(KEY)
    assert deadline.cut and proxy.cut_replies == proxy.whole_replies == 0
    assert store.stats.misses == {"io_error": 1} and not store._outage.blocked()
    assert store.get(KEY) is not None  # the control: outside the scope it is sent

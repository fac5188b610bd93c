"""cachefuse.redis_connection, through redis_client against a real redis-server behind a proxy that trickles
replies (tests/helpers/trickling_proxy.py): a call ends by its thread's deadline however its reply is
spread over socket reads, the connection it was cut on is dropped (the next call reads its own answer),
and outside a deadline scope the socket timeout alone applies (the control: the same call outlasts it)."""

from __future__ import annotations

import contextlib

import pytest
import redis

from cachefuse.call_deadline import calls_within
from cachefuse.redis_client import redis_client
from cachefuse.redis_connection import DeadlineConnection, DeadlineSSLConnection, DeadlineUnixConnection
from tests.helpers.redis_server import RedisServer
from tests.helpers.trickling_proxy import TestClock, TricklingProxy

TIMEOUT_S = 2.0  # the socket timeout, real seconds: longer than any pause of the proxy's in a control
BUDGET_S = 1.0  # the deadline, on the test clock
VALUE = bytes(range(256)) * 16  # 4 KiB: many pieces
PATTERNS = {  # (pieces per reply, clock step per piece)
    "trickled": (64, 0.05),  # 4 KiB in 64-byte pieces, 50 ms each: 3.2 s in all
    "each read just inside the socket timeout": (4, 0.95 * TIMEOUT_S),
}


@pytest.fixture
def proxied(redis_server: RedisServer, redis_namespace: str):
    """(client through the proxy, proxy, clock, key holding VALUE)."""
    clock = TestClock()
    key = f"{redis_namespace}:value"
    with TricklingProxy(redis_server.port, clock) as proxy, contextlib.closing(
            redis_client(proxy.url(), TIMEOUT_S)) as client:
        client.set(key, VALUE)  # connected and authenticated before any reply trickles
        yield client, proxy, clock, key


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_slow_reply_is_cut_at_the_deadline_and_its_connection_dropped(proxied, redis_namespace, pattern):
    client, proxy, clock, key = proxied
    pieces, step_s = PATTERNS[pattern]
    client.set(f"{redis_namespace}:other", b"other")
    proxy.trickle(pieces, step_s, hold_s=10.0)
    with calls_within(BUDGET_S, clock) as deadline, pytest.raises(redis.TimeoutError):
        client.get(key)
    assert deadline.cut and proxy.settled(1) and proxy.cut_replies == 1 and proxy.whole_replies == 0
    proxy.forward()
    assert client.get(f"{redis_namespace}:other") == b"other"  # not the rest of VALUE's reply

    proxy.trickle(pieces, step_s, hold_s=0.2)  # control: no deadline, the reply arrives whole
    start = clock()
    assert client.get(key) == VALUE
    assert clock() - start > BUDGET_S and proxy.settled(2) and proxy.whole_replies == 1


def test_a_call_that_ends_in_time_is_untouched(proxied):
    client, proxy, clock, key = proxied
    proxy.trickle(5, 0.1, hold_s=0.2)  # 5 pieces: 0.5 s, well inside the deadline
    with calls_within(10 * BUDGET_S, clock) as deadline:
        assert client.get(key) == VALUE
    assert not deadline.cut and proxy.settled(1) and proxy.whole_replies == 1


def test_no_call_is_sent_once_the_deadline_has_passed(proxied):
    client, proxy, clock, key = proxied
    with calls_within(BUDGET_S, clock) as deadline:
        clock.advance(BUDGET_S)
        with pytest.raises(redis.TimeoutError):
            client.get(key)
    assert deadline.cut and proxy.whole_replies == proxy.cut_replies == 0


def test_a_connection_opened_inside_a_deadline_scope_is_bounded_too(redis_server, redis_namespace):
    """A fresh client connects, authenticates and reads inside the scope (the pool was empty)."""
    clock = TestClock()
    with TricklingProxy(redis_server.port, clock) as proxy, contextlib.closing(
            redis_client(proxy.url(), TIMEOUT_S)) as client:
        proxy.trickle(8, 0.2, hold_s=10.0)  # the handshake's replies trickle too
        with calls_within(BUDGET_S, clock) as deadline, pytest.raises(redis.TimeoutError):
            client.get(f"{redis_namespace}:absent")
        assert deadline.cut and proxy.settled(1) and proxy.cut_replies == 1


@pytest.mark.parametrize(("url", "expected", "base"), [
    ("redis://127.0.0.1:6379/0", DeadlineConnection, redis.Connection),
    ("rediss://127.0.0.1:6380/0", DeadlineSSLConnection, redis.SSLConnection),
    ("unix:///run/redis.sock?db=0", DeadlineUnixConnection, redis.UnixDomainSocketConnection),
])
def test_every_url_scheme_gets_the_deadline_twin_of_its_connection(url, expected, base):
    """The twin of the class redis-py picks for the scheme (TLS and Unix sockets keep working)."""
    client = redis_client(url, TIMEOUT_S)
    assert client.connection_pool.connection_class is expected and issubclass(expected, base)

"""redis-py connections that end every call by the calling thread's deadline (cachefuse.call_deadline).

Imports socket, redis and `cachefuse.call_deadline`; no torch. `cachefuse.redis_client` builds every
client with these classes (TCP, TLS and Unix sockets alike). redis-py bounds each socket read by
`socket_timeout`, so a reply trickled in over many reads, or one whose reads each arrive just inside the
timeout, takes as long as the server likes. Here each read, write and connect gets the smaller of the
socket timeout and what is left of the deadline, and none starts once it has passed; a call cut so
raises redis.TimeoutError like any timeout, and redis-py drops the connection it was cut on (a reply
read halfway is never parsed as the next call's answer).

Outside a deadline scope nothing changes: the socket timeout alone applies.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from cachefuse import call_deadline

T = TypeVar("T")


class _DeadlineSocket:
    """A connected socket (plain or TLS) whose reads and writes end by the calling thread's deadline;
    everything else is the socket's own."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def recv(self, *args: Any) -> bytes:
        return _bounded(self._sock, self._sock.recv, args)

    def recv_into(self, *args: Any) -> int:
        return _bounded(self._sock, self._sock.recv_into, args)

    def sendall(self, *args: Any) -> None:
        # NOTE: Python bounds a whole sendall by the socket timeout, not each send inside it
        return _bounded(self._sock, self._sock.sendall, args)

    def send(self, *args: Any) -> int:
        return _bounded(self._sock, self._sock.send, args)


def _bounded(sock: socket.socket, op: Callable[..., T], args: tuple) -> T:
    """`op(*args)` on `sock` within the thread's deadline: socket.timeout, the deadline marked `cut`, when
    it has passed or passes during the operation."""
    deadline = call_deadline.current()
    timeout = sock.gettimeout()
    if deadline is None or timeout == 0:  # 0: a non-blocking poll (redis-py's can_read) waits for nothing
        return op(*args)
    left = deadline.left_s()
    if left <= 0:
        deadline.cut = True
        raise TimeoutError("the call's deadline has passed")
    if timeout is not None and timeout <= left:  # the socket timeout ends it first
        return op(*args)
    sock.settimeout(left)
    try:
        return op(*args)
    except TimeoutError:
        deadline.cut = True
        raise
    finally:
        sock.settimeout(timeout)


class _DeadlineConnect:
    """Mixin over a redis-py connection class: connect (and the TLS handshake) within the deadline, then
    every read and write through a _DeadlineSocket."""

    socket_timeout: float | None
    socket_connect_timeout: float | None

    def _connect(self):  # noqa: ANN202 - redis-py's own signature
        deadline = call_deadline.current()
        if deadline is None:
            return _DeadlineSocket(super()._connect())
        left = deadline.left_s()
        if left <= 0:
            deadline.cut = True
            raise TimeoutError("the call's deadline has passed")
        saved = self.socket_timeout, self.socket_connect_timeout
        bounded = [t is None or t > left for t in saved]
        self.socket_timeout, self.socket_connect_timeout = (left if b else t for b, t in zip(bounded, saved,
                                                                                           strict=True))
        try:
            sock = super()._connect()
        except TimeoutError:
            deadline.cut = deadline.cut or any(bounded)
            raise
        finally:
            self.socket_timeout, self.socket_connect_timeout = saved
        sock.settimeout(self.socket_timeout)
        return _DeadlineSocket(sock)


class DeadlineConnection(_DeadlineConnect, redis.Connection):
    """redis:// (TCP)."""


class DeadlineSSLConnection(_DeadlineConnect, redis.SSLConnection):
    """rediss:// (TLS)."""


class DeadlineUnixConnection(_DeadlineConnect, redis.UnixDomainSocketConnection):
    """unix:// (a local socket file)."""


def deadline_connection_class(url: str) -> type:
    """The connection class for `url`: the deadline-aware twin of the one redis-py picks for its scheme."""
    scheme = url.partition("://")[0].lower()
    return {"rediss": DeadlineSSLConnection, "unix": DeadlineUnixConnection}.get(scheme, DeadlineConnection)

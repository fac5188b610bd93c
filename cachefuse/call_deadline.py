"""A deadline for the network calls one thread makes inside a block: how a blend's load budget bounds a
single Redis call, not only the start of the next one.

Imports the standard library only (the scheduler's metadata modules and the loaders both use it). The
budget's owner opens a scope (`calls_within(seconds_left, clock)`); the Redis connections
(`cachefuse.redis_connection`) read the scope of the thread that drives them and end every socket read,
write or connect by its deadline, between the reads of one reply too: redis-py's own timeout applies per
socket read, so a reply trickled over many reads, or one read after another each just inside the
timeout, otherwise outlasts any budget. A call cut there marks its scope `cut`, which the owner reads to
tell "the budget ran out" (miss reason "load_timeout") from "the server failed" (an outage).

The scope is a context variable: a thread starts without one (the loader thread opens its own), so a
deadline never leaks into another thread's calls.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass
class CallDeadline:
    """The calls of one scope end by `at` on `clock` (seconds)."""

    at: float
    clock: Callable[[], float]
    cut: bool = False
    """A call of this scope was ended by the deadline (set by the connection that ended it)."""

    def left_s(self) -> float:
        return self.at - self.clock()


_current: contextvars.ContextVar[CallDeadline | None] = contextvars.ContextVar("cachefuse_call_deadline",
                                                                              default=None)


def current() -> CallDeadline | None:
    """The deadline of this thread's innermost open scope; None outside any."""
    return _current.get()


@contextlib.contextmanager
def calls_within(seconds_left: float | None, clock: Callable[[], float]) -> Iterator[CallDeadline | None]:
    """This thread's calls inside the block end within `seconds_left` from now on `clock` (None: no bound
    of this scope's own). An enclosing scope that ends earlier keeps its deadline; the scope in force is
    yielded (None when there is none), so the caller can read whether it cut a call."""
    outer = _current.get()
    if seconds_left is None:
        yield outer
        return
    deadline = CallDeadline(clock() + seconds_left, clock)
    if outer is not None and outer.left_s() <= deadline.left_s():
        yield outer
        return
    token = _current.set(deadline)
    try:
        yield deadline
    finally:
        _current.reset(token)


def passed() -> bool:
    """Whether this thread's deadline has passed: a call is then not sent at all, and the scope is marked
    `cut` (the call it refused is one it ended)."""
    deadline = _current.get()
    if deadline is None or deadline.left_s() > 0:
        return False
    deadline.cut = True
    return True


def cut_by_deadline() -> bool:
    """Whether this thread's scope has cut a call (what made the last failure a timeout of ours, not the
    server's: not evidence of an outage)."""
    deadline = _current.get()
    return deadline is not None and deadline.cut

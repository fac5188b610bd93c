"""A TCP proxy in front of a real redis-server that delivers replies slowly, and the test clock it drives.

Imports the standard library only. `TricklingProxy` forwards requests at once; while `trickle` is set,
it cuts each whole reply (framed by `reply_end`, RESP2 and RESP3) into `pieces` and, before sending each,
advances a `TestClock` by `step_s`: a reply that "takes" many steps on the clock a client's deadline is
read on, spread over many socket reads, the pattern redis-py's per-read timeout never ends. Before a
reply's last piece the proxy waits up to `hold_s` (real time) for the client to hang up; a client that
does was cut mid-reply (`cut_replies`), one that waits gets the rest (`whole_replies`). So the outcome
never depends on how fast either side runs: by the last piece the clock has passed whatever deadline
the test set, and the client has a piece still to read.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from dataclasses import dataclass


class TestClock:
    """A clock that moves only when told (seconds), safe to read and advance from several threads."""

    __test__ = False  # not a pytest test class

    def __init__(self) -> None:
        self._now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


def reply_end(buf: bytes, pos: int = 0) -> int | None:
    """The offset just past the RESP reply starting at `buf[pos]`; None if `buf` holds only part of it."""
    line_end = buf.find(b"\r\n", pos)
    if line_end < 0:
        return None
    kind, head, after = buf[pos:pos + 1], buf[pos + 1:line_end], line_end + 2
    if kind in b"$=!":  # bulk string, verbatim string, bulk error: a length, then that many bytes
        length = int(head)
        if length < 0:
            return after
        return after + length + 2 if len(buf) >= after + length + 2 else None
    if kind in b"*~>%|":  # array, set, push, map (2 per entry), attribute (2 per entry, then the reply)
        count = int(head)
        count = max(count, 0) * (2 if kind in b"%|" else 1) + (1 if kind == b"|" else 0)
        for _ in range(count):
            after = reply_end(buf, after)
            if after is None:
                return None
        return after
    return after  # a one-line reply: + - : _ , # (


@dataclass
class _Trickle:
    pieces: int
    step_s: float
    hold_s: float
    hold_from: float


class TricklingProxy:
    """A TCP proxy on a free loopback port in front of `target_port` (see the module docstring)."""

    _POLL_S = 0.01

    def __init__(self, target_port: int, clock: TestClock) -> None:
        self.target = ("127.0.0.1", target_port)
        self.clock = clock
        self.cut_replies = 0
        """Replies whose client hung up before their last piece (cut mid-reply)."""
        self.whole_replies = 0
        """Replies trickled to the end."""
        self._trickle: _Trickle | None = None
        self._counted = threading.Condition()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(self._POLL_S)
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept_thread = threading.Thread(target=self._accept_loop, name="trickling-proxy", daemon=True)
        self._accept_thread.start()

    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def trickle(self, pieces: int, step_s: float, hold_s: float = 2.0, hold_from: float = float("-inf")) -> None:
        """From now on every reply comes in `pieces` (fewer when it is shorter), the clock advanced `step_s`
        before each; before the last, the proxy waits up to `hold_s` for the client to hang up, once the
        clock reads `hold_from` or later (the client's deadline: a reply that ends before it is sent whole
        at once, so a call in time never waits out the hold)."""
        self._trickle = _Trickle(pieces, step_s, hold_s, hold_from)

    def forward(self) -> None:
        """Replies pass at once again."""
        self._trickle = None

    def settled(self, num_replies: int, timeout_s: float = 30.0) -> bool:
        """Waits until `num_replies` trickled replies have ended (cut or whole): the proxy learns of a hang-up
        after the client has moved on. False if they have not within `timeout_s` (a hung test, not a race)."""
        with self._counted:
            return self._counted.wait_for(lambda: self.cut_replies + self.whole_replies >= num_replies, timeout_s)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._pump, args=(client,), daemon=True)
            thread.start()
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _pump(self, client: socket.socket) -> None:
        """Requests upstream as they come; replies back whole (forwarding) or trickled, one at a time."""
        try:
            upstream = socket.create_connection(self.target, timeout=1.0)
            upstream.settimeout(None)
        except OSError:
            client.close()
            return
        pending = b""  # reply bytes from the server not yet sent on
        try:
            while not self._closed.is_set():
                readable, _, _ = select.select([client, upstream], [], [], self._POLL_S)
                if client in readable:
                    data = client.recv(65536)
                    if not data:
                        return
                    upstream.sendall(data)
                if upstream in readable:
                    data = upstream.recv(65536)
                    if not data:
                        return
                    pending += data
                pending, hung_up = self._send_replies(client, pending)
                if hung_up:
                    return
        except OSError:
            return
        finally:
            with contextlib.suppress(OSError):
                client.close()
            with contextlib.suppress(OSError):
                upstream.close()

    def _send_replies(self, client: socket.socket, pending: bytes) -> tuple[bytes, bool]:
        """Send the whole replies at the start of `pending` on to `client`; (what is left, client hung up)."""
        trickle = self._trickle
        if trickle is None:
            client.sendall(pending)
            return b"", False
        while (end := reply_end(pending)) is not None:
            reply, pending = pending[:end], pending[end:]
            if not self._send_trickled(client, reply, trickle):
                return pending, True
        return pending, False

    def _send_trickled(self, client: socket.socket, reply: bytes, trickle: _Trickle) -> bool:
        """One reply in pieces; False when the client hung up before its last piece."""
        size = -(-len(reply) // trickle.pieces)  # bytes per piece, rounded up
        pieces = [reply[i:i + size] for i in range(0, len(reply), size)]
        for index, piece in enumerate(pieces):
            last = index == len(pieces) - 1
            try:
                hold = last and self.clock() >= trickle.hold_from
                if _hangs_up(client, trickle.hold_s if hold else 0.0):
                    return self._count(cut=True)
                self.clock.advance(trickle.step_s)  # before the piece: a client that reads it sees the time taken
                client.sendall(piece)
            except OSError:  # hung up while the piece was on its way
                return self._count(cut=True)
            time.sleep(0.001)  # let the client read pieces one by one where it keeps up (not needed for the outcome)
        return self._count(cut=False)

    def _count(self, cut: bool) -> bool:
        with self._counted:
            if cut:
                self.cut_replies += 1
            else:
                self.whole_replies += 1
            self._counted.notify_all()
        return not cut

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        self._accept_thread.join(timeout=5)
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> TricklingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hangs_up(client: socket.socket, within_s: float) -> bool:
    """Whether `client` closes its end within `within_s` (a request it sends meanwhile would be a protocol
    error here: a cut client drops the connection, a waiting one sends nothing)."""
    readable, _, _ = select.select([client], [], [], within_s)
    if not readable:
        return False
    try:
        return client.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True

"""A throwaway redis-server per test session (or per test), a connection-dropping proxy, and their fixtures.

Imports redis and pytest only. `RedisServer` runs `redis-server` as a child process on a free loopback
port (no persistence, no daemon) and stops it by its PID, never by name. `DroppingProxy` sits between a
client and the server and can be switched to close or reset every connection, to test what a store does
when the network fails mid-flight. Registered as a pytest plugin by tests/conftest.py:

- `redis_url` (session): a shared server; each test keeps to its own namespace (`redis_namespace`).
- `redis_namespace` (function): a unique key prefix, its keys deleted after the test.
- `private_redis` (function): a server of the test's own, to stop, restart, pause or freeze.

A missing redis-server fails these fixtures (never skips): the Redis backends must be tested in CI.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

INSTALL_HINT = "redis-server not found on PATH: install it (`apt-get install redis-server`, or `make redis`)"
_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 5.0


def free_port() -> int:
    """A loopback TCP port nobody listens on right now (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One redis-server child process on 127.0.0.1 (see the module docstring).

    Args:
        password: passed as --requirepass and put into `url`.
        executable: the server binary; default: `redis-server` on PATH.
    """

    def __init__(self, password: str | None = None, executable: str | None = None) -> None:
        self.executable = executable or shutil.which("redis-server")
        if self.executable is None:
            raise FileNotFoundError(INSTALL_HINT)
        self.password = password
        self.port = free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="cachefuse-redis-"))
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self, timeout_s: float | None = 5.0) -> redis.Redis:
        """A plain client (bytes replies) for test set-up and inspection."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def start(self) -> RedisServer:
        """Start the server (again, on the same port after `stop`) and wait until PING answers."""
        if self._proc is not None and self._proc.poll() is None:
            return self
        args = [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--dir", str(self._dir), "--logfile", "server.log"]
        if self.password:
            args += ["--requirepass", self.password]
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT_S
        probe = self.client(timeout_s=0.5)
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited ({self._proc.returncode}): {self._log_tail()}")
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                    if probe.ping():
                        return self
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not answer PING within {_START_TIMEOUT_S} s")
                time.sleep(0.02)
        finally:
            probe.close()

    def stop(self) -> None:
        """Terminate the server by its PID (SIGTERM, then SIGKILL after a timeout); idempotent."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=_STOP_TIMEOUT_S)

    def pause(self, ms: int) -> None:
        """CLIENT PAUSE ALL for `ms` milliseconds, sent by a separate client.

        NOTE: Redis 7.0 holds back even CLIENT UNPAUSE while paused, so a pause cannot be ended early;
        keep `ms` short and use `wait_unpaused` before the recovery checks.
        """
        with contextlib.closing(self.client()) as admin:
            admin.client_pause(ms, all=True)

    @contextlib.contextmanager
    def frozen(self):
        """The server stopped (SIGSTOP) until the block ends (SIGCONT): connections open and every reply
        waits, for however long the block takes. Unlike `pause`, nothing ends it early, so a test on a
        loaded machine cannot see it answer before the block is done."""
        assert self._proc is not None and self._proc.poll() is None, "the server is not running"
        os.kill(self._proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self._proc.pid, signal.SIGCONT)

    def wait_unpaused(self, timeout_s: float = 10.0) -> None:
        """Block until the server answers again (a blocking PING returns once a pause ends)."""
        with contextlib.closing(self.client(timeout_s=timeout_s)) as admin:
            admin.ping()

    def _log_tail(self) -> str:
        log = self._dir / "server.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class DroppingProxy:
    """A TCP proxy on a free loopback port: forwards to `target_port`, or drops every connection.

    `mode` is "forward" (pass bytes both ways), "close" (accept, then close: the client reads EOF) or
    "reset" (accept, then close with SO_LINGER 0: the client gets ECONNRESET). Switching away from
    "forward" also drops the connections already open, within one poll interval.
    """

    MODES = ("forward", "close", "reset")
    _POLL_S = 0.02

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.mode = "forward"
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(self._POLL_S)
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept_thread = threading.Thread(target=self._accept_loop, name="dropping-proxy", daemon=True)
        self._accept_thread.start()

    def url(self, password: str | None = None) -> str:
        auth = f":{password}@" if password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def set_mode(self, mode: str) -> None:
        if mode not in self.MODES:
            raise ValueError(f"mode={mode!r}, expected one of {self.MODES}")
        self.mode = mode
        time.sleep(2 * self._POLL_S)  # let the pumps notice and drop what is open

    def _drop(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            if self.mode == "reset":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.mode != "forward":
                self._drop(client)
                continue
            thread = threading.Thread(target=self._pump, args=(client,), daemon=True)
            thread.start()
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _pump(self, client: socket.socket) -> None:
        """Copy bytes both ways until either side closes, the mode changes, or the proxy closes."""
        try:
            upstream = socket.create_connection(self.target, timeout=1.0)
            upstream.settimeout(None)
        except OSError:
            self._drop(client)
            return
        peers = {client: upstream, upstream: client}
        try:
            while self.mode == "forward" and not self._closed.is_set():
                readable, _, _ = select.select(list(peers), [], [], self._POLL_S)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    peers[sock].sendall(data)
        except OSError:
            return
        finally:
            self._drop(client)
            self._drop(upstream)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        self._accept_thread.join(timeout=5)
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> DroppingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def delete_namespace(client: redis.Redis, namespace: str) -> None:
    """Delete every key under `namespace:` (SCAN, so a big shared server is not blocked)."""
    keys = list(client.scan_iter(match=f"{namespace}:*", count=500))
    for start in range(0, len(keys), 500):
        client.delete(*keys[start:start + 500])


def _server_or_fail() -> RedisServer:
    if shutil.which("redis-server") is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    return RedisServer()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """The session's shared server (tests on it must keep to their own namespace)."""
    server = _server_or_fail()
    with server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def redis_namespace(redis_server: RedisServer) -> Iterator[str]:
    """A key prefix no other test uses; its keys are deleted afterwards."""
    namespace = f"test-{uuid.uuid4().hex[:12]}"
    yield namespace
    with contextlib.closing(redis_server.client()) as client:
        delete_namespace(client, namespace)


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A server of this test's own: stop, restart or pause it freely."""
    server = _server_or_fail()
    with server:
        yield server


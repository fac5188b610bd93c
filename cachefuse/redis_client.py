"""One way to reach Redis: a client that never retries, and URLs safe to print.

Imports the standard library and cachefuse.errors; no torch (the scheduler's metadata reads use it), and
redis only inside `redis_client` (it is an optional extra, and `redact_url` serves every process). Both
Redis users, the K/V tier (`cachefuse.store.redis`) and the metadata store (`cachefuse.metadata.redis`),
get their clients here, so a shared cache behaves the same everywhere: every call fails within about
the timeout, and by the calling thread's deadline where one is open (cachefuse.call_deadline, through
cachefuse.redis_connection's connections), an outage costs two timeouts a second at most (OutageBackoff),
and no message or log line carries a password.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit, urlunsplit

from cachefuse.errors import ConfigError

if TYPE_CHECKING:
    import redis


OUTAGE_BACKOFF_S = 1.0
"""How long the stores send no call once Redis has stopped answering (OutageBackoff)."""


class OutageBackoff:
    """Whether a store should send calls to its Redis. A server that does not answer (a partition, a frozen
    host) answers no faster a moment later, and each call would wait out the socket timeout again, one
    per chunk, pin and reuse of every request; so once it has not answered for a whole socket timeout
    after a first timeout (a second timeout at least `timeout_s` later, no answer between), calls are not
    sent for `backoff_s`. One timeout alone, or several at once from threads caught in one stall, may be
    a busy server (another client's long script) and start none. Thread-safe; `clock` is injectable."""

    def __init__(self, timeout_s: float, backoff_s: float = OUTAGE_BACKOFF_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.backoff_s, self.clock = timeout_s, backoff_s, clock
        self._lock = threading.Lock()
        self._streak_start: float | None = None  # the first timeout since the last answer
        self._until = float("-inf")

    def blocked(self) -> bool:
        return self.clock() < self._until

    def timed_out(self) -> None:
        with self._lock:
            now = self.clock()
            if self._streak_start is None:
                self._streak_start = now
            elif now - self._streak_start >= self.timeout_s:
                self._until = now + self.backoff_s

    def answered(self) -> None:
        """The server answered (a reply, an error reply included): not an outage."""
        self._streak_start = None

    def failed(self, exc: BaseException) -> None:
        """A call failed with `exc`: a timeout counts towards an outage, an error reply (or a reply that
        did not parse) is an answer, a refused or reset connection (it fails at once) is neither."""
        import redis

        if isinstance(exc, redis.TimeoutError):
            self.timed_out()
        elif not isinstance(exc, redis.ConnectionError):
            self.answered()


def require_redis_package(what: str) -> None:
    """Raises ConfigError naming `what` (the field or argument that asked for Redis) and the install
    command when redis-py is not installed: it is an optional extra, and without it the first Redis call
    died with a bare ModuleNotFoundError inside the worker."""
    import importlib.util

    if importlib.util.find_spec("redis") is None:
        raise ConfigError(f"{what} needs the redis package, which is not installed: "
                          "pip install 'cachefuse[redis]' (or pip install redis)")


def redis_client(url: str, timeout_s: float, *, decode_responses: bool = False) -> redis.Redis:
    """A client whose every call fails within about `timeout_s` (connect and each reply), never retried,
    and ends by the calling thread's deadline where one is open (cachefuse.call_deadline: a blend's load
    budget), however its reply is spread over socket reads (cachefuse.redis_connection).

    NOTE: redis-py retries failed calls by default (with backoff); a shared cache must answer "miss"
    after one timeout instead, so the retry policy is set to none.

    Args:
        url: "redis://[[user]:password@]host:port/db" or "rediss://..." (TLS).
        timeout_s: socket connect and read timeout, seconds.
        decode_responses: replies as str (metadata) instead of bytes (K/V tensors).

    Raises:
        ConfigError: the URL cannot be parsed.
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from cachefuse.redis_connection import deadline_connection_class

    if not timeout_s > 0:
        raise ConfigError(f"redis timeout_s={timeout_s!r}, expected > 0")
    try:
        return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                    retry_on_timeout=False, retry=Retry(NoBackoff(), 0),
                                    decode_responses=decode_responses,
                                    connection_class=deadline_connection_class(url))
    except ValueError as exc:
        expected = "redis://host:port/db or rediss://..."
        raise ConfigError(f"redis_url={redact_url(url)!r}: {exc}; expected {expected}") from None


def redact_url(url: str) -> str:
    """`url` with its credentials masked, for messages and logs.

    The password becomes `***` ("redis://user:secret@host:6379/0" -> "redis://user:***@host:6379/0");
    a lone user-info part ("redis://secret@host"), which some servers read as a password, and the
    user-info of a URL that does not parse are masked whole; so is a `password=` (or `username=`) query
    parameter, which redis-py reads as the password; a URL with none of these is returned unchanged.
    """
    url = _QUERY_SECRET.sub(lambda m: f"{m.group(1)}***", url)
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # a malformed port or netloc
        parts, password = None, None
    if parts is None or (password is None and "@" in url):
        head, sep, tail = url.rpartition("@")
        if not sep:
            return url
        scheme, colon, _ = head.partition("://")
        return f"{scheme}://***@{tail}" if colon else f"***@{tail}"
    if password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


_QUERY_SECRET = re.compile(r"([?&](?:password|username)=)[^&#]*", re.IGNORECASE)


def url_with_password(url: str, password: str) -> str:
    """`url` with `password` as its password (replacing any in it), the user name kept:
    ("redis://host:6379/0", "s3cret") -> "redis://:s3cret@host:6379/0"."""
    parts = urlsplit(url)
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


def check_eviction_policy(client: redis.Redis) -> None:
    """Refuses a server that may evict any key when full (`maxmemory-policy allkeys-*` with a `maxmemory`):
    Redis would drop cachefuse's bookkeeping (the K/V tier's byte count and LRU order, the metadata's
    eviction order, generation and counters) as readily as entries, and the byte budget then breaks for
    good (entries past it, or every save refused). Entries carry no TTL, so `noeviction` and the
    `volatile-*` policies never evict them behind cachefuse's back. Unreachable, or CONFIG refused (a
    managed Redis), it checks nothing.

    Raises:
        ConfigError: the policy evicts any key.
    """
    import redis

    try:
        config = client.config_get("maxmemory*")
    except redis.RedisError:
        return
    config = {_text(k): _text(v) for k, v in config.items()}
    policy, maxmemory = config.get("maxmemory-policy", ""), config.get("maxmemory", "0")
    if policy.startswith("allkeys-") and maxmemory not in ("", "0"):
        raise ConfigError(
            f"redis_url: the server's maxmemory-policy is {policy} (maxmemory {maxmemory} bytes): when full, "
            "Redis would evict cachefuse's bookkeeping keys along with entries and break its byte budget for "
            "good. Set maxmemory-policy to noeviction (or a volatile-* policy) and bound cachefuse's share "
            "with redis_capacity_bytes")


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)

"""One way to reach Redis: a client whose every call fails within its timeout, never retried.

Imports the standard library and cachefuse.errors; no torch (the scheduler's metadata reads use it), and
redis only inside `redis_client` (it is an optional extra). Both Redis users, the K/V tier
(`cachefuse.store.redis`) and the metadata store (`cachefuse.metadata.redis`), get their clients here,
so a shared cache behaves the same everywhere: every call fails within about the timeout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cachefuse.errors import ConfigError

if TYPE_CHECKING:
    import redis


def redis_client(url: str, timeout_s: float, *, decode_responses: bool = False) -> redis.Redis:
    """A client whose every call fails within about `timeout_s` (connect and each reply), never retried.

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

    if not timeout_s > 0:
        raise ConfigError(f"redis timeout_s={timeout_s!r}, expected > 0")
    try:
        return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                    retry_on_timeout=False, retry=Retry(NoBackoff(), 0),
                                    decode_responses=decode_responses)
    except ValueError as exc:
        expected = "redis://host:port/db or rediss://..."
        raise ConfigError(f"redis_url={url!r}: {exc}; expected {expected}") from None


"""cachefuse.redis_client: URLs are masked before they reach a message, and a bad URL fails as config."""

import pytest

from cachefuse.errors import ConfigError
from cachefuse.redis_client import redact_url, redis_client


@pytest.mark.parametrize(("url", "expected"), [
    ("redis://user:secret@host:6379/0", "redis://user:***@host:6379/0"),
    ("rediss://:secret@host:6380/1", "rediss://:***@host:6380/1"),
    ("redis://secret@host/0", "redis://***@host/0"),  # a lone user-info part may be a password
    ("redis://user:secret@host:notaport/0", "redis://user:***@host:notaport/0"),
    ("redis://a@b:secret@host/0", "redis://a@b:***@host/0"),  # the user-info ends at the last "@"
    ("redis://host:6379/0", "redis://host:6379/0"),  # nothing to hide: unchanged
    ("unix:///run/redis.sock", "unix:///run/redis.sock"),
])
def test_redact_url_masks_credentials(url, expected):
    assert redact_url(url) == expected
    assert "secret" not in redact_url(url)


def test_a_bad_url_is_a_config_error_that_keeps_the_password_out():
    with pytest.raises(ConfigError, match=r"redis_url=") as caught:
        redis_client("redis://user:secret@host:notaport/0", 0.5)
    assert "secret" not in str(caught.value) and "***" in str(caught.value)


def test_a_nonpositive_timeout_is_a_config_error():
    with pytest.raises(ConfigError, match="timeout_s"):
        redis_client("redis://localhost:6379/0", 0.0)

"""cachefuse.redis_client: URLs are masked before they reach a message, a bad URL fails as config, and the
password can come from an environment variable or a file instead of the URL."""

import pytest

from cachefuse.config import CacheFuseConfig
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
    # redis-py also reads the password from the query
    ("redis://host:6379/0?password=secret", "redis://host:6379/0?password=***"),
    ("redis://host/0?db=1&Password=secret&x=1", "redis://host/0?db=1&Password=***&x=1"),
    ("unix:///run/redis.sock?password=secret", "unix:///run/redis.sock?password=***"),
    ("redis://u:secret@host/0?password=secret", "redis://u:***@host/0?password=***"),
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


def test_the_password_comes_from_an_environment_variable_or_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CF_TEST_REDIS_PASSWORD", "s3cr/et")
    config = CacheFuseConfig(redis_url="redis://host:6379/0", redis_password_env="CF_TEST_REDIS_PASSWORD")
    assert config.redis_connection_url == "redis://:s3cr%2Fet@host:6379/0"
    assert "s3cr" not in repr(config) and "s3cr" not in str(config.to_dict())
    (tmp_path / "pw").write_text("from-file\n")
    config = CacheFuseConfig(redis_url="redis://user:old@host/1", redis_password_file=str(tmp_path / "pw"))
    assert config.redis_connection_url == "redis://user:from-file@host/1"  # overrides the URL's
    assert CacheFuseConfig(redis_url="redis://h/0").redis_connection_url == "redis://h/0"


@pytest.mark.parametrize(("fields", "name"), [
    ({"redis_url": "redis://h/0", "redis_password_env": "CF_TEST_UNSET_VARIABLE"}, "redis_password_env"),
    ({"redis_url": "redis://h/0", "redis_password_file": "/nonexistent/pw"}, "redis_password_file"),
    ({"redis_password_env": "HOME"}, "redis_url"),
    ({"redis_url": "redis://h/0", "redis_password_env": "HOME", "redis_password_file": "/x"}, "redis_password_file"),
])
def test_a_password_source_that_does_not_work_fails_at_start_up(fields, name):
    with pytest.raises(ConfigError) as caught:
        CacheFuseConfig(**fields)
    assert str(caught.value).startswith(f"{name}=")


def test_a_store_reaches_a_password_protected_redis_with_the_password_from_the_environment(monkeypatch):
    from cachefuse.metadata.backends import open_config_metastore
    from tests.helpers.redis_server import RedisServer

    with RedisServer(password="pw-from-env") as server:
        bare_url = f"redis://127.0.0.1:{server.port}/0"
        monkeypatch.setenv("CF_TEST_REDIS_PASSWORD", "pw-from-env")
        config = CacheFuseConfig(redis_url=bare_url, redis_password_env="CF_TEST_REDIS_PASSWORD")
        store = open_config_metastore(config)
        assert store.count() == 0
        store.close()
        with pytest.raises(ConfigError, match="refused the credentials"):  # negative control: no password
            open_config_metastore(CacheFuseConfig(redis_url=bare_url))  # a wrong password fails at start-up


def test_a_rejected_url_is_shown_without_its_password():
    with pytest.raises(ConfigError) as caught:
        CacheFuseConfig(redis_url="http://:hunter2@cache:6379/0")
    assert "hunter2" not in str(caught.value) and "http://:***@cache:6379/0" in str(caught.value)


def test_inspect_prints_an_unreachable_store_without_its_password(capsys):
    from cachefuse.cli.main import main
    from tests.helpers.redis_server import free_port

    assert main(["inspect", "--store", f"redis://:hunter2@127.0.0.1:{free_port()}/0"]) == 1
    err = capsys.readouterr().err
    assert "hunter2" not in err and ":***@127.0.0.1" in err


def test_the_outage_backoff_starts_only_when_redis_stops_answering_for_a_whole_timeout():
    """Timeouts of one stall (a busy server's long script, several threads caught at once) start no
    backoff; a second timeout a whole socket timeout after the first, no answer between, does, for
    OUTAGE_BACKOFF_S; an answer (an error reply counts) ends the streak."""
    from cachefuse.redis_client import OutageBackoff

    now = [0.0]
    outage = OutageBackoff(timeout_s=0.5, backoff_s=1.0, clock=lambda: now[0])
    outage.timed_out()
    outage.timed_out()  # another thread, the same stall
    assert not outage.blocked()
    now[0] = 0.4
    outage.timed_out()
    assert not outage.blocked()
    now[0] = 0.5
    outage.answered()  # the server answered: the streak ends
    now[0] = 1.0
    outage.timed_out()
    assert not outage.blocked()
    now[0] = 1.5
    outage.timed_out()  # a whole timeout later, no answer between: an outage
    assert outage.blocked()
    now[0] = 2.49
    assert outage.blocked()
    now[0] = 2.5
    assert not outage.blocked()  # a call is sent again; timing out now restarts the backoff at once
    outage.timed_out()
    assert outage.blocked()

"""The error types of cachefuse; everyone may import this module, it imports nothing."""


class CacheFuseError(Exception):
    """Base class of every error cachefuse raises on purpose."""


class ConfigError(CacheFuseError, ValueError):
    """A configuration field has a bad value; the message names the field, the value and the fix."""


class UnsupportedModelError(CacheFuseError):
    """The model (architecture, RoPE variant, attention kind) is one cachefuse does not implement."""


class StoreError(CacheFuseError):
    """A store operation failed in a way the caller must see (never raised for a plain miss)."""


class RequestError(CacheFuseError, ValueError):
    """A per-request parameter is malformed; the request runs as plain vLLM and reports `field`.

    Attributes:
        field: the offending key path in `kv_transfer_params`, e.g. "cachefuse.chunks[2]".
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class RequestLimitError(RequestError):
    """A well-formed request beyond a configured bound (chunk count, chunk length, text bytes); it runs
    as plain vLLM with the reason `over_limit`, so that no request can make `schedule()` do unbounded work."""

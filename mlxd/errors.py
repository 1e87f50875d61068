"""Errors are values with a type and an HTTP status; the API layer renders them per dialect."""

from __future__ import annotations


class MlxdError(Exception):
    """Base error. `kind` is dialect-neutral; each API maps it to its own error type name."""

    status: int = 500
    kind: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}


class InvalidRequest(MlxdError):
    status = 400
    kind = "invalid_request"


class Unauthorized(MlxdError):
    status = 401
    kind = "authentication"


class Forbidden(MlxdError):
    status = 403
    kind = "permission"


class NotFound(MlxdError):
    status = 404
    kind = "not_found"


class RequestTimedOut(MlxdError):
    status = 408
    kind = "timeout"


class RequestTooLarge(MlxdError):
    status = 413
    kind = "request_too_large"


class Overloaded(MlxdError):
    status = 429
    kind = "rate_limit"


class Unavailable(MlxdError):
    status = 503
    kind = "overloaded"


class ConfigError(MlxdError):
    """A config file that cannot be parsed or validated. The message names file, line and key."""

    status = 400
    kind = "invalid_request"


class ModelLoadError(MlxdError):
    """A model whose source is missing, corrupt or unsupported. The message names the model.

    Such a failure recurs on every try with the same files and config (`recurs`): the model is
    marked failed and not retried until its source or the YAML changes, instead of re-reading
    gigabytes on a backoff. Failures that may pass are `TransientLoadError`s.
    """

    status = 503
    kind = "overloaded"
    recurs = True


class TransientLoadError(ModelLoadError):
    """A load failure that may pass (a worker killed while loading, a download that failed, a
    full disk): retried on the backoff."""

    recurs = False

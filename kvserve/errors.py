"""The KVServeError family: raised at the edges, mapped to OpenAI-shaped errors by the API."""

from __future__ import annotations


class KVServeError(Exception):
    """Base of every error a user can see. `status` is the HTTP status the API maps it to."""

    status = 500
    error_type = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ConfigError(KVServeError):
    status = 400
    error_type = "invalid_request_error"


class InvalidRequestError(KVServeError):
    status = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(KVServeError):
    status = 404
    error_type = "invalid_request_error"


class UnsupportedModelError(KVServeError):
    status = 400
    error_type = "invalid_request_error"


class OverloadedError(KVServeError):
    status = 503
    error_type = "server_error"


class RequestTimeoutError(KVServeError):
    status = 504
    error_type = "timeout_error"


class UnavailableError(KVServeError):
    """A part of the server failed while it held the request (a cluster replica died): retry."""

    status = 503
    error_type = "server_error"

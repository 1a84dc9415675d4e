"""Errors a client may see, each with the HTTP status it maps to.

Pure Python (no torch, no Ray): the engine raises them, they cross Ray Serve as pickled
exceptions, and the HTTP front end turns each into OpenAI's error JSON. Their messages are
written for clients: they never carry tracebacks, process ids, addresses or paths.
"""

from __future__ import annotations


class KVRayError(Exception):
    """Base of the errors below: ``status`` is the HTTP status, ``err_type`` OpenAI's type."""

    status = 500
    err_type = "InternalServerError"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param

    def __reduce__(self):  # pickle (Ray) keeps param
        return (self.__class__, (self.message, self.param))


class InvalidRequestError(KVRayError, ValueError):
    """A request parameter is invalid; ``param`` names it."""

    status = 400
    err_type = "BadRequestError"


class NotFoundError(KVRayError, LookupError):
    """The request names something this server does not have (a model or adapter)."""

    status = 404
    err_type = "NotFoundError"


class ServerBusyError(KVRayError):
    """Admission refused for now (full queue, draining, engine restarting): retry later."""

    status = 503
    err_type = "ServiceUnavailableError"
    retry_after_s = 1


class RequestTimeoutError(KVRayError):
    """The request passed its deadline (``request_timeout_s``) and was aborted."""

    status = 408
    err_type = "TimeoutError"


class EngineUnavailableError(KVRayError):
    """The engine failed while the request was in flight (a worker died or stopped
    answering); the request was aborted and the engine recovers for later ones."""

    status = 503
    err_type = "ServiceUnavailableError"
    retry_after_s = 1

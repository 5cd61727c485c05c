"""Errors as OpenAI answers them: ``{"error": {"message", "type", "param", "code"}}`` with OpenAI's statuses.

Every refusal of the API is an :class:`ApiError`; :func:`from_engine` translates the engine's errors (their
messages already name the place and the fix); the launch-token guard (studio/guard.py) refuses ``/v1/``
paths in the same shape. No traceback reaches a client: an exception nobody
anticipated is logged once and answered as a 500 naming its type.
"""

from __future__ import annotations

import logging

from engine.errors import ContextLengthError, EngineError, ModelError, PMLError, RunStopped, StorageError

log = logging.getLogger("pml-studio.api")

INVALID = "invalid_request_error"
SERVER = "server_error"


class ApiError(Exception):
    """A refused or failed API request: its HTTP status and OpenAI's four error fields."""

    def __init__(self, status: int, message: str, type: str = INVALID, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_engine(err: BaseException, param: str | None = None) -> ApiError:
    """The ApiError a client gets for ``err``, raised while running its request (``param``: the request field
    that held the documents, named in input errors)."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, ContextLengthError):
        return ApiError(400, _plain(str(err)), param=param, code="context_length_exceeded")
    if isinstance(err, PMLError):
        return ApiError(400, _plain(str(err)), param="pml", code="invalid_pml")
    if isinstance(err, RunStopped):
        return ApiError(499, str(err), code="client_closed_request")
    if isinstance(err, ModelError):
        return ApiError(503, f"the model cannot be used: {err}", type=SERVER, code="model_unavailable")
    if isinstance(err, StorageError):
        return ApiError(400, str(err), code="module_store")
    if isinstance(err, EngineError):
        return ApiError(400, _plain(str(err)), param=param, code="invalid_request")
    log.error("an API request failed", exc_info=err)  # the one traceback, for a failure nobody anticipated
    return ApiError(500, f"the request failed: {type(err).__name__}: {err}", type=SERVER, code="internal_error")


def _plain(text: str) -> str:
    return text.replace("<schema>:", "schema ").replace("<prompt>:", "prompt ")

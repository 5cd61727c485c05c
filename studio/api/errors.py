"""Errors as OpenAI answers them: ``{"error": {"message", "type", "param", "code"}}``; no traceback reaches a
client."""

from __future__ import annotations

import logging

from engine.errors import ContextLengthError, EngineError, ModelError, PMLError, StorageError, shorten

log = logging.getLogger("pml-studio.api")

INVALID = "invalid_request_error"
SERVER = "server_error"
MAX_MESSAGE = 32_000  # characters of an error's message: 20 located problems fit; a 4 MB name echoed back does not


class ApiError(Exception):
    """``retry_after``: seconds a client should wait before it asks again (a 429's ``Retry-After``)."""

    def __init__(self, status: int, message: str, type: str = INVALID, param: str | None = None,
                 code: str | None = None, retry_after: int | None = None):
        message = shorten(message, MAX_MESSAGE)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


def from_engine(err: BaseException, param: str | None = None) -> ApiError:
    """``param``: the request field that held the documents, named in input errors."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, ContextLengthError):
        return ApiError(400, _plain(str(err)), param=param, code="context_length_exceeded")
    if isinstance(err, PMLError):
        return ApiError(400, _plain(str(err)), param="pml", code="invalid_pml")
    if isinstance(err, ModelError):
        return ApiError(503, f"the model cannot be used: {err}", type=SERVER, code="model_unavailable")
    if isinstance(err, StorageError):
        return ApiError(400, str(err), code="module_store")
    if isinstance(err, EngineError):
        return ApiError(400, _plain(str(err)), param=param, code="invalid_request")
    log.error("an API request failed", exc_info=err)  # the one traceback, for the unanticipated
    return ApiError(500, f"the request failed: {type(err).__name__}: {err}", type=SERVER, code="internal_error")


def _plain(text: str) -> str:
    return text.replace("<schema>:", "schema ").replace("<prompt>:", "prompt ")

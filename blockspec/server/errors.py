"""Errors the routes answer with: the OpenAI error object and its status."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from blockspec.server.protocol import error_body

RETRY_AFTER_S = 1


class ApiError(Exception):
    """An answer other than 200, sent as the OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param), self.status, self.headers)


class GenerationFailed(Exception):
    """The engine ended a request with an error, or dropped it at shutdown (finish_reason abort)."""

    def __init__(self, status: int, message: str, finish_reason: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.finish_reason = status, message, finish_reason
        self.index = 0                     # the choice it ended (set where several are merged)


def retry_later(message: str) -> ApiError:
    return ApiError(503, message, headers={"Retry-After": str(RETRY_AFTER_S)})

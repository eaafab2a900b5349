"""Errors the routes answer with: the OpenAI error object and its status, and pydantic's
validation errors said as OpenAI says them (one 400, never 422)."""
from __future__ import annotations

from typing import Any

import pydantic
from fastapi.responses import JSONResponse

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


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {
        "error": {
            "message": message,
            "type": kind,
            "param": param,
            "code": status if code is None else code,
        }
    }


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_union_tag(part: str) -> bool:
    """pydantic names union members in `loc` ('str', 'list[str]', 'NamedToolChoice', ...)."""
    return part in _UNION_TAGS or part[:1].isupper() or any(c in part for c in "[](),-")


def _param_name(loc: tuple[int | str, ...]) -> str | None:
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif not _is_union_tag(part):
            name += f".{part}" if name else part
    return name or None


def _shown_input(value: Any) -> str:
    if isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 40):
        return f" (got {value!r})"
    return ""


def validation_error_message(exc: pydantic.ValidationError) -> tuple[str, str | None]:
    """One clear message and the offending parameter for a 400 answer (the first error wins)."""
    error = exc.errors(include_url=False)[0]
    kind, param = error["type"], _param_name(tuple(error["loc"]))
    if kind == "json_invalid":
        detail = error["msg"].removeprefix("Invalid JSON: ")
        return f"The request body is not valid JSON: {detail}.", None
    if kind in ("model_type", "model_attributes_type") and param is None:
        return "The request body must be a JSON object.", None
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param
    if kind == "value_error":
        reason = error["ctx"]["error"]
        return (f"Invalid '{param}': {reason}." if param else f"{reason}."), param
    msg = error["msg"][:1].lower() + error["msg"][1:]
    return f"Invalid '{param}': {msg}{_shown_input(error.get('input'))}.", param

"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with a status."""

from __future__ import annotations

import math
import re

import msgspec
from aiohttp import web

from streamengine.server import protocol as p
from streamengine.server.failures import Failure

_STATUS_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
    429: "rate_limit_error", 503: "server_error",
}
_AT_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")


class OpenAIError(Exception):
    """Answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> web.Response:
        return error_response(self.status, self.message, type_=self.type, param=self.param, code=self.code,
                              headers=self.headers)

    def body(self) -> dict:
        return error_body(self.message, type_=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, *, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    body = error_body(message, type_=type_, param=param, code=code)
    return web.json_response(body, status=status, headers=headers)


def http_exception_response(exc: web.HTTPException) -> web.Response:
    """Any aiohttp HTTP error (404 route, 405, 413 body too large) in OpenAI's error shape."""
    code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}.get(exc.status)
    message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
    return error_response(exc.status, message.strip(), type_=_STATUS_TYPES.get(exc.status, "server_error"),
                          code=code, headers={k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")})


def failure_error(failure: Failure) -> OpenAIError:
    """The OpenAI error for a request the engine refused or failed (see failures.classify)."""
    param = failure.limit if failure.limit is not None else ("prompt" if failure.code == p.PROMPT_TOO_LONG else None)
    headers = None
    if failure.retry_after is not None:  # Retry-After takes whole seconds
        headers = {"Retry-After": str(max(1, math.ceil(failure.retry_after)))}
    return OpenAIError(failure.status, failure.message, type_=_STATUS_TYPES.get(failure.status, "server_error"),
                       param=param, code=failure.openai_code, headers=headers)


def validation_error(exc: msgspec.ValidationError | ValueError) -> OpenAIError:
    """A 400 whose `param` names the offending field, where msgspec or SamplingParams says it."""
    message = str(exc)
    param = None
    if match := _AT_PATH.search(message):
        param = match.group(1) or None
        message = message[: match.start()]
    elif match := _SAMPLING_FIELD.match(message):
        param = match.group(1)
    return OpenAIError(400, message, param=param)

"""How a request that ended with an exception is reported: one classifier for both protocols.

The WebSocket sends `Failure.code` in an `error` message; the OpenAI routes answer with
`Failure.status` and OpenAI's `Failure.openai_code`. Exceptions that are not the engine's nor
the request's fault (a bug) classify as None: each route reports those its own way.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamengine.errors import (
    EngineError,
    EngineOverloadedError,
    GrammarError,
    GrammarOverloadedError,
    LimitExceededError,
    PromptTooLong,
)
from streamengine.server import protocol as p
from streamengine.server.streaming import RequestTimeoutError
from streamengine.tenancy.tenants import TenantRateLimitError


@dataclass(frozen=True, slots=True)
class Failure:
    code: str  # the WebSocket protocol's error code (protocol.py)
    status: int  # the HTTP status
    openai_code: str | None  # OpenAI's `error.code`
    message: str
    limit: str | None = None  # with LIMIT_EXCEEDED, or OVERLOADED by a tenant's rate or grammar queue: which limit
    retry_after: float | None = None  # with OVERLOADED: seconds to wait before retrying


# First match wins: subclasses before their bases (PromptTooLong, LimitExceededError and
# GrammarError are ValueErrors, the "your request is wrong" family, GrammarError also when a
# grammar gives out while decoding; the others are the engine's, GrammarOverloadedError an
# EngineOverloadedError: a full compile queue is a 429, never a 500).
_RULES: tuple[tuple[type[Exception], str, int, str | None], ...] = (
    (PromptTooLong, p.PROMPT_TOO_LONG, 400, "context_length_exceeded"),
    (LimitExceededError, p.LIMIT_EXCEEDED, 400, "limit_exceeded"),
    (GrammarError, p.INVALID_GRAMMAR, 400, "invalid_grammar"),
    (ValueError, p.BAD_PARAMS, 400, None),
    (TenantRateLimitError, p.OVERLOADED, 429, "rate_limit_exceeded"),
    (EngineOverloadedError, p.OVERLOADED, 429, "overloaded"),
    (RequestTimeoutError, p.TIMEOUT, 504, "timeout"),
    (EngineError, p.ENGINE_ERROR, 500, "engine_error"),
)


def classify(exc: BaseException) -> Failure | None:
    """The report for a request that ended with `exc`; None for an unexpected exception."""
    rule = next((rule for rule in _RULES if isinstance(exc, rule[0])), None)
    if rule is None:
        return None
    kind, code, status, openai_code = rule
    message = str(exc) or type(exc).__name__
    if kind is ValueError and "context length" in message:
        openai_code = "context_length_exceeded"  # the engine's own prompt-length check
    return Failure(
        code, status, openai_code, message,
        limit=exc.limit if isinstance(exc, LimitExceededError | TenantRateLimitError | GrammarOverloadedError) else None,
        retry_after=float(exc.retry_after) if isinstance(exc, EngineOverloadedError) else None,
    )

"""The engine's exceptions, shared by the engine and the server (which maps each to a status).

`ValueError` stays the base of every "your request is wrong" error, so callers that catch it
keep working; the others are `EngineError`s: the request was fine, the engine could not serve it.
"""

from __future__ import annotations


class LimitExceededError(ValueError):
    """A request goes past one of the engine's or server's configured limits.

    `limit` names the limit (a config field, CLI option or SamplingParams bound) so a client
    can tell which one; the message says the value and the maximum.
    """

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


class PromptTooLong(ValueError):
    """The prompt has more tokens (or characters) than the server's `max_prompt_tokens` allows."""


class GrammarError(ValueError):
    """A structured-output spec that cannot be used: it does not compile, it did not compile
    within the engine's timeout (the message names it), or the model's vocabulary cannot carry
    it. Also raised when a request's grammar refuses a token its own mask allowed: the spec
    went past llguidance's limits while decoding (a schema no finite value matches, a regex
    whose lexer outgrows them), which fails that request alone as the client's error."""


class EngineError(RuntimeError):
    """The engine could not serve a request that was itself valid."""


class EngineDeadError(EngineError):
    """The engine stopped; requests still in flight end with this."""


class RequestFailedError(EngineError):
    """This request was ended by a fault inside the engine (a failed step, a core restart).
    Other requests go on; the message says what happened."""


class EngineOverloadedError(EngineError):
    """Admission refused because the queue is full; try again after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class GrammarOverloadedError(EngineOverloadedError):
    """A structured-output spec was not compiled because the compile queue is full (for its
    tenant, or in all), or it waited there past its bound. `limit` names the EngineConfig field."""

    def __init__(self, limit: str, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message, retry_after)
        self.limit = limit

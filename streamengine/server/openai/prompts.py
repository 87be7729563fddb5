"""A request's prompts as the engine runs them: the forms `/v1/completions` takes, each
tokenized, truncated as `truncate_prompt_tokens` asks, checked against the server's limit,
and the text `echo` puts before each of its choices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streamengine.errors import PromptTooLong
from streamengine.server.openai.errors import OpenAIError
from streamengine.server.state import ServerState

MAX_PROMPTS = 256
"""Prompts one /v1/completions request may batch (each is its own engine request)."""


@dataclass(slots=True)
class PromptJob:
    """One prompt of a request: its token ids, and the text echoed before each of its choices
    (None without echo)."""

    ids: list[int]
    echo: str | None = None


@dataclass(frozen=True, slots=True)
class Truncation:
    """vLLM's truncate_prompt_tokens: keep `tokens` of the prompt, the last ones ("left": the
    start is cut, the default) or the first ones ("right"); -1 keeps the model's length."""

    tokens: int
    side: str = "left"

    def apply(self, ids: list[int], max_model_len: int | None) -> list[int]:
        keep = max_model_len if self.tokens == -1 else self.tokens
        if keep is None or len(ids) <= keep:
            return ids
        return ids[-keep:] if self.side == "left" else ids[:keep]


def truncation(tokens: int | None, side: str | None) -> Truncation | None:
    if tokens is None:
        if side is not None:
            raise OpenAIError(400, "truncation_side needs truncate_prompt_tokens", param="truncation_side")
        return None
    if tokens < 1 and tokens != -1:
        raise OpenAIError(400, f"truncate_prompt_tokens must be >= 1 or -1 (the model's length), got {tokens}",
                          param="truncate_prompt_tokens")
    return Truncation(tokens, side or "left")


def completion_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """`prompt` as a list of prompts: a string, a list of strings, a list of token ids, or a
    list of token-id lists (OpenAI's four forms)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise _bad_prompt()
    if all(_is_id(t) for t in prompt):
        return [prompt]
    if not (all(isinstance(p, str) for p in prompt)
            or all(isinstance(p, list) and p and all(map(_is_id, p)) for p in prompt)):
        raise _bad_prompt()
    if len(prompt) > MAX_PROMPTS:
        raise OpenAIError(400, f"prompt holds {len(prompt)} prompts, more than the maximum of {MAX_PROMPTS}",
                          param="prompt", code="limit_exceeded")
    return list(prompt)


async def prompt_job(state: ServerState, prompt: str | list[int], *, add_special_tokens: bool,
                     cut: Truncation | None, echo: bool | str) -> PromptJob:
    """The prompt's ids, truncated and checked against the server's limit. `echo`: True for the
    prompt's own text, a string for that text, False for none."""
    try:
        ids = await state.tokenize_async(prompt, chat=not add_special_tokens, check_limit=False)
        kept = cut.apply(ids, _max_model_len(state)) if cut is not None else ids
        state.check_length(kept)
    except PromptTooLong as exc:
        raise OpenAIError(400, str(exc), param="prompt", code="context_length_exceeded") from None
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="prompt") from None
    if echo is True:  # the prompt as given, unless truncation cut it
        echo = prompt if isinstance(prompt, str) and kept is ids else state.engine.tokenizer.decode(kept)
    return PromptJob(kept, echo or None)


def _max_model_len(state: ServerState) -> int | None:
    return state.engine.stats().get("max_model_len")


def _is_id(token: Any) -> bool:
    return isinstance(token, int) and not isinstance(token, bool)


def _bad_prompt() -> OpenAIError:
    return OpenAIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                       "token-id lists, and not empty", param="prompt")

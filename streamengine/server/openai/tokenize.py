"""vLLM's tokenizer routes: `POST /tokenize` (a prompt, or chat messages rendered by the chat
template as `/v1/chat/completions` renders them) and `POST /detokenize`.

Their answers are vLLM's: `{"count", "max_model_len", "tokens"}` (and `token_strs` with
`return_token_strs`), and `{"prompt"}`. The server's `max_prompt_tokens` does not apply: a
client may count a prompt to learn that it is too long.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from streamengine.server.openai import schemas as s
from streamengine.server.openai.endpoints import check_model, decode_body, message_dict
from streamengine.server.openai.errors import OpenAIError
from streamengine.server.openai.fields import unsupported
from streamengine.server.state import (
    BadTemplateOptions,
    ChatTemplateOptions,
    ServerState,
    get_state,
)
from streamengine.server.tools import plan_tools


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's TokenizeCompletionRequest (`prompt`) and TokenizeChatRequest (`messages`) in one."""

    model: str | None = None
    prompt: str | None = None
    messages: list[s.ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[s.Tool] | None = None
    return_token_strs: bool | None = False
    chat_template: str | None = None  # refused
    mm_processor_kwargs: dict[str, Any] | None = None  # refused


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


async def tokenize(request: web.Request) -> web.Response:
    state = get_state(request)
    body = decode_body(await request.read(), TokenizeRequest)
    check_model(state, body.model)
    for name, reason in (("chat_template", "templates are not taken from requests"),
                         ("mm_processor_kwargs", "this server serves text models only")):
        if getattr(body, name) is not None:
            raise unsupported(name, reason)
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError(400, "give either prompt or messages", param="prompt")
    if body.prompt is not None:
        text, special = body.prompt, body.add_special_tokens is not False
    else:
        text, special = _chat_text(state, body), bool(body.add_special_tokens)
    try:
        ids = await state.tokenize_async(text, chat=not special, check_limit=False)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="prompt") from None
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": state.engine.stats().get("max_model_len"),
                              "tokens": ids}
    if body.return_token_strs:
        answer["token_strs"] = state.engine.tokenizer.convert_ids_to_tokens(ids)
    return web.json_response(answer)


async def detokenize(request: web.Request) -> web.Response:
    state = get_state(request)
    body = decode_body(await request.read(), DetokenizeRequest)
    check_model(state, body.model)
    vocab = len(state.engine.tokenizer)
    if bad := [t for t in body.tokens if not 0 <= t < vocab]:
        raise OpenAIError(400, f"token id {bad[0]} is out of range [0, {vocab})", param="tokens")
    return web.json_response({"prompt": state.engine.tokenizer.decode(body.tokens)})


def _chat_text(state: ServerState, body: TokenizeRequest) -> str:
    messages = [message_dict(m, i) for i, m in enumerate(body.messages or ())]
    try:
        options = ChatTemplateOptions(body.add_generation_prompt is not False, bool(body.continue_final_message),
                                      dict(body.chat_template_kwargs or {}))
    except BadTemplateOptions as exc:
        raise OpenAIError(400, str(exc), param=exc.param) from None
    functions = None
    if body.tools:
        functions = plan_tools(body.tools, None, parallel=False, parser_name=state.config.tool_parser).functions
    try:
        return state.chat_prompt(messages, functions, options)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="messages") from None
